"""`python count_loads.py RECIPE ARGS...`: run a recipe with every full-model load (`from_pretrained`) recorded in
`$LOAD_LOG/rank<RANK>.txt`, one line per call (the checkpoint it loaded), for `test_at_scale.py`."""

import os
import runpy
import sys
from pathlib import Path

import megatron_spec.models as models
import megatron_spec.models.hf_io as hf_io

_real = hf_io.from_pretrained
_log = Path(os.environ["LOAD_LOG"]) / f"rank{os.environ.get('RANK', '0')}.txt"
_log.touch()


def _counted(path, *args, **kwargs):
    with open(_log, "a") as f:
        f.write(f"{path}\n")
    return _real(path, *args, **kwargs)


hf_io.from_pretrained = models.from_pretrained = _counted
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
