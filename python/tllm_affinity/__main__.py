"""``python -m tllm_affinity ARGS``: the ``tllm-affinity`` command installed with this package.

The wheel installs the command in the environment's scripts directory (bin/); pip's record of the
installed files names it exactly, whichever scheme (venv, --user, --prefix) put it there. The
process is replaced by the command, so signals and the exit status are the command's own.
"""
import os
import shutil
import sys

COMMAND = "tllm-affinity"


def _installed_command():
    try:
        from importlib.metadata import PackageNotFoundError, distribution
    except ImportError:  # Python < 3.8 has no importlib.metadata; PATH is the only clue.
        return None
    try:
        files = distribution("tllm-affinity").files or []
    except PackageNotFoundError:
        return None
    for file in files:
        if file.name == COMMAND and file.parent.name == "bin":
            path = str(file.locate())
            if os.access(path, os.X_OK):
                return path
    return None


def main():
    command = _installed_command() or shutil.which(COMMAND)
    if command is None:
        sys.stderr.write(
            "python -m tllm_affinity: the %s command is not installed with this package (it was "
            "installed from python/ alone); install the tllm-affinity wheel, which carries it\n" % COMMAND
        )
        return 2
    os.execv(command, [command] + sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
