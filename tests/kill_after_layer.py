"""Run the quantkit command line in this process and kill it (os._exit) at a checkpoint of layer K.

    python tests/kill_after_layer.py K PHASE quantize ARGS...

PHASE "committed": right after layer K's checkpoint is committed (every rank exits there under torchrun);
"uncommitted": once layer K's files are written, before state.json names them (one process only: rank 0
writes state.json). The exit code is KILLED_EXIT. tests/test_resume.py and tests/test_reliability.py run
this script as a subprocess, so a real process dies where a crash could hit.
"""

import json
import os
import sys

KILLED_EXIT = 86


def command(layer, phase="committed"):
    """The argv prefix that runs the CLI under this script (append "quantize", ...)."""
    return [sys.executable, __file__, str(layer), phase]


def install(layer, phase):
    """Patch quantkit's layer checkpoint so the process exits at (layer, phase)."""
    from quantkit.engine import checkpoint

    commit = checkpoint.LayerCheckpoint.commit
    write_text = checkpoint.LayerCheckpoint._atomic_write_text

    def commit_then_exit(self, index, *args, **kwargs):
        commit(self, index, *args, **kwargs)
        if phase == "committed" and index == layer:
            os._exit(KILLED_EXIT)

    def exit_before_state(path, text):
        if phase == "uncommitted" and path.name == checkpoint.STATE and json.loads(text)["layers_done"] == layer + 1:
            os._exit(KILLED_EXIT)
        write_text(path, text)

    checkpoint.LayerCheckpoint.commit = commit_then_exit
    checkpoint.LayerCheckpoint._atomic_write_text = staticmethod(exit_before_state)


if __name__ == "__main__":
    layer, phase, args = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
    if phase not in ("committed", "uncommitted"):
        raise SystemExit(f"PHASE must be committed or uncommitted, not {phase!r}")
    install(layer, phase)
    from quantkit.cli import main

    main(args, prog_name="quantkit")
