/*
 * spank_nocontainer: pyxis's srun options on a node that runs no containers (the local test cluster).
 *
 * NeMo-Run's SlurmExecutor always runs its task as
 *     srun --container-mounts JOB_DIR:/nemo_run --container-workdir /nemo_run/code ... bash /nemo_run/scripts/x.sh
 * which needs the pyxis SPANK plugin. This plugin gives the same options their meaning without an image: each
 * --container-mounts SRC:DST is bind-mounted at DST in a mount namespace private to the task (so nothing outside it
 * sees the mount), and the task starts in --container-workdir. --container-image is refused with a clear error:
 * there is no container runtime here. The other pyxis flags NeMo-Run and our templates pass are accepted and mean
 * nothing without a container (the environment already reaches the task; there is no home to mount or remap).
 *
 * plugstack line:  required /path/spank_nocontainer.so created=/path/created-dirs
 * Mount points that did not exist are created and their paths appended to `created`, so the cluster's `stop` can
 * remove them.
 */
#define _GNU_SOURCE /* unshare, CLONE_NEWNS */
#include <errno.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include <slurm/spank.h>

SPANK_PLUGIN(nocontainer, 1);

static char *mounts = NULL;
static char *workdir = NULL;
static char created_log[4096] = "";

static int set_mounts(int val, const char *arg, int remote) {
    free(mounts);
    mounts = strdup(arg);
    return 0;
}

static int set_workdir(int val, const char *arg, int remote) {
    free(workdir);
    workdir = strdup(arg);
    return 0;
}

static int refuse_image(int val, const char *arg, int remote) {
    slurm_error("nocontainer: --container-image=%s: this cluster runs no containers (no pyxis/enroot); "
                "leave the container image out", arg);
    return -1;
}

static int ignore(int val, const char *arg, int remote) { return 0; }

struct spank_option spank_options[] = {
    {"container-image", "IMAGE", "[nocontainer] refused: this cluster runs no containers", 1, 0, refuse_image},
    {"container-mounts", "SRC:DST[,SRC:DST...]", "[nocontainer] bind-mount SRC at DST for the task", 1, 0,
     set_mounts},
    {"container-workdir", "PATH", "[nocontainer] the task's working directory", 1, 0, set_workdir},
    {"container-env", "NAME[,NAME...]", "[nocontainer] accepted; the environment reaches the task as it is", 1, 0,
     ignore},
    {"no-container-mount-home", NULL, "[nocontainer] accepted; no effect without a container", 0, 0, ignore},
    {"no-container-remap-root", NULL, "[nocontainer] accepted; no effect without a container", 0, 0, ignore},
    SPANK_OPTIONS_TABLE_END};

int slurm_spank_init(spank_t sp, int ac, char **av) {
    for (int i = 0; i < ac; i++)
        if (strncmp(av[i], "created=", 8) == 0)
            snprintf(created_log, sizeof created_log, "%s", av[i] + 8);
    return 0;
}

/* mkdir -p, logging each directory it creates. */
static int make_dirs(const char *path) {
    char buf[4096];
    snprintf(buf, sizeof buf, "%s", path);
    for (char *p = buf + 1;; p++) {
        if (*p == '/' || *p == '\0') {
            char keep = *p;
            *p = '\0';
            if (mkdir(buf, 0755) == 0) {
                if (created_log[0]) {
                    FILE *f = fopen(created_log, "a");
                    if (f) {
                        fprintf(f, "%s\n", buf);
                        fclose(f);
                    }
                }
            } else if (errno != EEXIST) {
                slurm_error("nocontainer: mkdir %s: %s", buf, strerror(errno));
                return -1;
            }
            *p = keep;
            if (keep == '\0')
                return 0;
        }
    }
}

/* In the task, before it drops privileges: a private mount namespace with each SRC:DST bound. */
int slurm_spank_task_init_privileged(spank_t sp, int ac, char **av) {
    if (!spank_remote(sp) || mounts == NULL || mounts[0] == '\0')
        return 0;
    if (unshare(CLONE_NEWNS) != 0 || mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) != 0) {
        slurm_error("nocontainer: private mount namespace: %s", strerror(errno));
        return -1;
    }
    char *list = strdup(mounts), *save = NULL;
    for (char *item = strtok_r(list, ",", &save); item; item = strtok_r(NULL, ",", &save)) {
        char *dst = strchr(item, ':');
        if (dst == NULL) {
            slurm_error("nocontainer: mount %s is not SRC:DST", item);
            free(list);
            return -1;
        }
        *dst++ = '\0';
        char *flags = strchr(dst, ':'); /* pyxis's SRC:DST:FLAGS; flags other than the bind itself are ignored */
        if (flags)
            *flags = '\0';
        if (make_dirs(dst) != 0 || mount(item, dst, NULL, MS_BIND | MS_REC, NULL) != 0) {
            slurm_error("nocontainer: bind %s at %s: %s", item, dst, strerror(errno));
            free(list);
            return -1;
        }
    }
    free(list);
    return 0;
}

/* Last thing before the task's exec: its working directory. */
int slurm_spank_task_init(spank_t sp, int ac, char **av) {
    if (!spank_remote(sp) || workdir == NULL)
        return 0;
    if (chdir(workdir) != 0) {
        slurm_error("nocontainer: --container-workdir %s: %s", workdir, strerror(errno));
        return -1;
    }
    return 0;
}
