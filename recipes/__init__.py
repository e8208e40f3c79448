"""Recipe files, one per (model, size): `python recipes/<name>.py key=value ... [--dryrun] [--executor ...]`
(or `nemo-run recipes/<name>.py ...`, the same program). Shared code in `_common.py`; `configs/<name>.yaml` is
generated from each recipe by `python -m recipes.gen_configs`. Installed with the project, so recipes import
`recipes._common` and `launchers` without path edits."""
