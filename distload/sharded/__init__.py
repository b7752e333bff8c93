"""distload's sharded saves (DESIGN §4.3): writing one (save.py), its format and manifest (manifest.py),
and reloading one as a source of the load pipeline (reload.py)."""
