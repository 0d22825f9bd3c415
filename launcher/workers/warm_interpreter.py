"""The program of a warm worker: an interpreter that imports torch ahead of its round, then runs the script.

The agent starts it (under the same supervisor as a cold worker) with the round-independent part of the
worker environment and one end of a SOCK_SEQPACKET socket pair in `ELASTIC_WARM_CONTROL_FD`. It imports
torch, torch.distributed and the torch modules the script imports (`torch_imports`), writes
to the pipe in `ELASTIC_WARM_READY_FD` to say so, and waits for one launch message: a JSON object (`env`,
`argv`) with the worker's stdout and stderr attached as file descriptors (and any further descriptors, each named by the
environment variable in `fd_env`: the worker's round socket). It then becomes
`python script.py args`: stdout/stderr on those descriptors, the round's environment, `sys.argv`,
`sys.path[0]` the script's directory, the script run as `__main__`; its exit code and uncaught exception are
the script's. The socket closing without a message (the agent is gone, or no round needs this interpreter)
ends it with status 0.

Run as a file, never imported by the worker: nothing of `launcher` stays in the script's `sys.modules`. Its
command line ends with the script and its arguments, so `ps` and `pgrep -f script.py` find the worker.
"""

import ast
import builtins
import importlib
import importlib.machinery
import io
import json
import os
import signal
import socket
import sys
import types

CONTROL_FD_ENV = "ELASTIC_WARM_CONTROL_FD"
# the write end of a pipe, written once the imports are done. Not the control socket: a socket closed by the
# agent with an unread message in it resets the connection, and the launch message behind it would be lost
READY_FD_ENV = "ELASTIC_WARM_READY_FD"
MAX_LAUNCH_BYTES = 4 << 20
MAX_LAUNCH_FDS = 8  # stdout, stderr and the descriptors named in `fd_env`
# the process name (/proc/<pid>/comm) while it waits, so that `ps` tells a spare from a worker; a launched one
# takes back the interpreter's own name, as a cold worker has it
IDLE_NAME = "elastic-warm"
_PR_SET_NAME = 15
# What an FSDP2 + DCP training script pays for in its first second besides torch itself, measured on
# examples/train.py: `import torch.distributed.fsdp` (0.7 s) and the torch._dynamo that fully_shard's first call
# imports (1.0 s). Only torch's own modules are loaded early (they read nothing of the round's environment at
# import), and only those the script imports itself: a script that needs none pays nothing for them.
IMPORTED_WITH = {"torch.distributed.fsdp": ("torch._dynamo",)}


def _set_process_name(name: bytes) -> None:
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(_PR_SET_NAME, name[:15])


def _wait_for_launch(control: socket.socket) -> tuple[dict, list[int]] | None:
    message, fds, _, _ = socket.recv_fds(control, MAX_LAUNCH_BYTES, MAX_LAUNCH_FDS)
    if not message:
        return None
    return json.loads(message), fds


def main() -> None:
    control = socket.socket(fileno=int(os.environ.pop(CONTROL_FD_ENV)))
    ready = int(os.environ.pop(READY_FD_ENV))
    own_name = _own_name()
    _set_process_name(IDLE_NAME.encode())
    import torch  # noqa: F401  (the cost a warm worker pays before its round, not in it)
    import torch.distributed  # noqa: F401  (the part every elastic-run script uses)

    for module in torch_imports(sys.argv[1]) if len(sys.argv) > 1 else ():
        try:
            importlib.import_module(module)
        except ImportError:
            pass  # not in this torch: the script fails on its own import of it, as it would cold
    try:
        os.write(ready, b"1")  # the agent of a node joining a running job waits for this before it registers
    except OSError:
        pass  # the agent no longer listens (EPIPE): it launched us already, or gave us up
    os.close(ready)

    launch = _wait_for_launch(control)
    control.close()
    if launch is None:
        os._exit(0)
    order, (stdout_fd, stderr_fd, *extra_fds) = launch
    for fd, target in ((stdout_fd, 1), (stderr_fd, 2)):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(order["env"])
    for name, fd in zip(order.get("fd_env", []), extra_fds):
        os.set_inheritable(fd, True)  # as a cold worker's: the script's own subprocess may be the one to use it
        os.environ[name] = str(fd)
    sys.argv = list(order["argv"])
    _set_process_name(own_name)
    _run_as_main(sys.argv[0])


def torch_imports(script: str) -> list[str]:
    """The torch modules `script` imports at its top level (in `try` blocks too), with what they load on first
    use (`IMPORTED_WITH`); none when it cannot be read or parsed: the script then says why when it runs."""
    try:
        with io.open_code(os.path.abspath(script)) as source:
            tree = ast.parse(source.read())
    except (OSError, SyntaxError, ValueError):
        return []
    statements = list(tree.body)
    for statement in tree.body:
        if isinstance(statement, ast.Try):
            statements += statement.body
    names = []
    for statement in statements:
        if isinstance(statement, ast.Import):
            names += [alias.name for alias in statement.names]
        elif isinstance(statement, ast.ImportFrom) and statement.module and not statement.level:
            names.append(statement.module)
    found = [name for name in dict.fromkeys(names) if name == "torch" or name.startswith("torch.")]
    return found + [extra for name in found for extra in IMPORTED_WITH.get(name, ())]


def _own_name() -> bytes:
    try:
        with open("/proc/self/comm", "rb") as comm:
            return comm.read().rstrip(b"\n")
    except OSError:
        return b""


def _run_as_main(script: str) -> None:
    """What `python script` does with its script: its directory first on sys.path, a fresh `__main__` module
    (kept, as the interpreter keeps it: pickling and atexit see it) with an absolute `__file__`."""
    path = os.path.abspath(script)
    sys.path[0] = os.path.dirname(os.path.realpath(script))
    main = types.ModuleType("__main__")
    main.__dict__.update(
        __file__=path,
        __cached__=None,
        __loader__=importlib.machinery.SourceFileLoader("__main__", path),
        __builtins__=builtins,
    )
    sys.modules["__main__"] = main
    with io.open_code(path) as source:
        code = compile(source.read(), path, "exec")
    exec(code, main.__dict__)


def _report_as_python_would(exc: BaseException) -> None:
    """An uncaught exception of the script, shown and ending the process as `python script` would: the
    traceback from the script's own frames, exit status 1, or death by SIGINT for a KeyboardInterrupt."""
    traceback = exc.__traceback__
    while traceback is not None and traceback.tb_frame.f_code.co_filename == __file__:
        traceback = traceback.tb_next
    sys.excepthook(type(exc), exc.with_traceback(traceback), traceback)
    if isinstance(exc, KeyboardInterrupt):
        sys.stdout.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    sys.exit(1)


if __name__ == "__main__":
    try:
        main()
    except SystemExit:
        raise
    except BaseException as exc:
        _report_as_python_would(exc)
