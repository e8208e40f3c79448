"""Recipe files, one per (model, size): `python recipes/<name>.py key=value ... [--dryrun] [--executor ...]`
(or `nemo-run recipes/<name>.py ...`). Shared code in `_common.py`; the matching YAML in `configs/<name>.yaml`."""
