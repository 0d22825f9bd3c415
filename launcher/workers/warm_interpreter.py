"""The program of a node's zygote, and of the warm workers forked from it, that then run the script.

The agent starts one zygote per node (`launcher.workers.zygote`) with the round-independent part of the worker
environment and one end of a SOCK_SEQPACKET socket pair in `ELASTIC_ZYGOTE_FD`. It imports torch,
torch.distributed and the torch modules the script imports (`torch_imports`), says `ready`, and then serves the
agent: for each request (a JSON `fork` with a warm worker's control socket attached) it forks a supervisor
(`launcher.workers.process_tree.supervise`), which forks the warm worker, and it answers with the supervisor's
pid; when a supervisor exits it sends its exit code (`exited`), as `Popen.returncode` would have it. It starts
no thread and initialises no device before it forks, so a fork costs milliseconds and the child inherits the
imports.

The warm worker waits for one launch message on its control socket: a JSON object (`env`, `argv`) with the
worker's stdout and stderr attached as file descriptors (and any further descriptors, each named by the
environment variable in `fd_env`: the worker's round socket). It then becomes `python script.py args`:
stdout/stderr on those descriptors, the round's environment, `sys.argv`, `sys.path[0]` the script's directory,
the script run as `__main__`; its exit code and uncaught exception are the script's. The socket closing without a
message (the agent is gone, or no round needs this worker) ends it with status 0. What a fresh interpreter
would have differently is made fresh: the signal handlers Python installs, the random seeds (`random` reseeds
itself at fork, numpy's global generator is reseeded here), and nothing of `launcher` in `sys.modules` or its
root on `sys.path`.

Run as a file, never imported by the worker. Its command line ends with the script and its arguments, so `ps`
and `pgrep -f script.py` find the worker (and the zygote and the supervisors, which share it: their process
names tell them apart).
"""

import ast
import builtins
import ctypes
import gc
import importlib
import importlib.machinery
import io
import json
import os
import select
import signal
import socket
import sys
import types
from pathlib import Path

ZYGOTE_FD_ENV = "ELASTIC_ZYGOTE_FD"
MAX_MESSAGE_BYTES = 4 << 20
MAX_LAUNCH_FDS = 8  # stdout, stderr and the descriptors named in `fd_env`
# process names (/proc/<pid>/comm), so that `ps` tells the zygote, a supervisor and a waiting worker from a
# worker; a launched one takes back the interpreter's own name, as a cold worker has it
ZYGOTE_NAME = "elastic-zygote"
SUPERVISOR_NAME = "elastic-superv"
IDLE_NAME = "elastic-warm"
STORE_NAME = "elastic-store"
STANDBY_NAME = "elastic-standby"  # a launched worker waiting in elastic.run for its first round (standby.py)
_PR_SET_NAME = 15
_PR_SET_PDEATHSIG = 1
# What an FSDP2 + DCP training script pays for in its first second besides torch itself, measured on
# examples/train.py: `import torch.distributed.fsdp` (0.7 s) and the torch._dynamo that fully_shard's first call
# imports (1.0 s). Only torch's own modules are loaded early (they read nothing of the round's environment at
# import), and only those the script imports itself: a script that needs none pays nothing for them.
IMPORTED_WITH = {"torch.distributed.fsdp": ("torch._dynamo",)}
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


class _Forked(Exception):
    """Raised in a new warm worker, to leave the zygote's and the supervisor's code for its own."""


def set_process_name(name: str) -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(_PR_SET_NAME, name.encode()[:15])


def process_name(pid: int | str = "self") -> str:
    """The name of process `pid` (/proc/<pid>/comm); empty if it is gone."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().rstrip("\n")
    except OSError:
        return ""


def _die_with_parent() -> None:
    """SIGKILL this process when its parent dies (the caller then checks that the parent is still the one)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _send(channel: socket.socket, message: dict) -> None:
    try:
        channel.send(json.dumps(message).encode())
    except OSError:
        os._exit(0)  # the agent is gone; the supervisors die with us (their parent-death signal)


def main() -> None:
    requests = socket.socket(fileno=int(os.environ.pop(ZYGOTE_FD_ENV)))
    own_name = process_name()
    set_process_name(ZYGOTE_NAME)
    import torch  # noqa: F401  (the cost the zygote pays once, before any round, not in it)
    import torch.distributed  # noqa: F401  (the part every elastic-run script uses)

    for module in torch_imports(sys.argv[1]) if len(sys.argv) > 1 else ():
        try:
            importlib.import_module(module)
        except ImportError:
            pass  # not in this torch: the script fails on its own import of it, as it would cold
    handlers = {signum: signal.getsignal(signum) for signum in _catchable_signals()}
    added = _PACKAGE_ROOT not in sys.path
    if added:
        sys.path.append(_PACKAGE_ROOT)
    from launcher.workers.process_tree import supervise

    # what the imports built lives as long as the worker: out of the collector's sight, a full collection in a
    # worker (elastic.run runs one at each round change) walks only the script's objects (0.24 s -> ms with
    # examples/train.py), and does not write to, and so copy, the pages the forks share with the zygote
    gc.freeze()
    _send(requests, {"ready": True})
    control = _serve(requests, lambda me, ignored: _start_warm_worker(me, handlers), supervise)
    # a warm worker from here on
    for name in [m for m in sys.modules if m == "launcher" or m.startswith("launcher.")]:
        del sys.modules[name]
    if added:
        sys.path.remove(_PACKAGE_ROOT)
    if "numpy.random" in sys.modules:
        sys.modules["numpy.random"].seed()  # from the OS's entropy, as a fresh interpreter's first import does
    _run_launch(control, own_name)


def _serve(requests: socket.socket, start_worker, supervise) -> socket.socket:
    """Fork a supervisor and its warm worker for each request, and report each supervisor's exit, until the
    agent closes its end; returns only in a forked warm worker, its control socket."""
    zygote = os.getpid()
    supervisors: dict[int, int] = {}  # pidfd -> pid
    while True:
        readable, _, _ = select.select([requests.fileno(), *supervisors], [], [])
        for fd in readable:
            if fd in supervisors:
                pid = supervisors.pop(fd)
                os.close(fd)
                _, status = os.waitpid(pid, 0)
                _send(requests, {"exited": pid, "code": os.waitstatus_to_exitcode(status)})
        if requests.fileno() not in readable:
            continue
        message, fds, _, _ = socket.recv_fds(requests, MAX_MESSAGE_BYTES, 1)
        if not message:
            os._exit(0)
        if not fds:
            continue
        order = json.loads(message)
        pid = os.fork()
        if pid == 0:
            requests.close()
            for fd in supervisors:
                os.close(fd)
            if "store" in order:
                _serve_store(socket.socket(fileno=fds[0]), **order["store"])
            os.setsid()  # the supervisor leads its group, as a cold one started with start_new_session does
            try:
                supervise(zygote, start_worker, name=SUPERVISOR_NAME)
            except _Forked:
                return socket.socket(fileno=fds[0])
        os.close(fds[0])
        supervisors[os.pidfd_open(pid)] = pid
        _send(requests, {"forked": pid})


def _serve_store(control: socket.socket, host: str, world_size: int) -> None:
    """In a process just forked from the zygote: serve a round's TCPStore (what torchrun's agent serves with
    TORCHELASTIC_USE_AGENT_STORE) on a port of its own, say which on `control`, and serve until `control` closes
    (the round is over) or the zygote dies. Listening before any worker starts, it spares the workers torch's
    half-second back-off after a refused connection, which they met when rank 0 had not yet started its own."""
    try:
        _die_with_parent()
        set_process_name(STORE_NAME)
        from datetime import timedelta

        from torch.distributed import TCPStore

        store = TCPStore(host, 0, world_size, True, timedelta(seconds=60), wait_for_workers=False, use_libuv=True)
        control.send(json.dumps({"port": store.port}).encode())
        control.recv(1)
    except BaseException as exc:  # noqa: BLE001 - nothing may return into the zygote's loop in this child
        os.write(2, f"elastic-run: the round's store could not be served: {exc!r}\n".encode())
        os._exit(1)
    os._exit(0)


def _start_warm_worker(supervisor: int, handlers: dict) -> None:
    """In the warm worker, just forked by its supervisor: the zygote's signal handlers (a fresh interpreter's),
    death with the supervisor, the waiting name; then out of the supervisor's code."""
    for signum, handler in handlers.items():
        try:
            signal.signal(signum, handler)
        except (OSError, ValueError, TypeError):
            pass
    _die_with_parent()
    if os.getppid() != supervisor:
        os._exit(0)
    set_process_name(IDLE_NAME)
    raise _Forked


def _catchable_signals() -> list[int]:
    return [s for s in signal.valid_signals() if s not in (signal.SIGKILL, signal.SIGSTOP)]


def _wait_for_launch(control: socket.socket) -> tuple[dict, list[int]] | None:
    message, fds, _, _ = socket.recv_fds(control, MAX_MESSAGE_BYTES, MAX_LAUNCH_FDS)
    if not message:
        return None
    return json.loads(message), fds


def _run_launch(control: socket.socket, own_name: str) -> None:
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
    set_process_name(order.get("name") or own_name)
    _run_as_main(sys.argv[0])


def _parsed(script: str) -> ast.Module | None:
    """`script`'s syntax tree; None when it cannot be read or parsed: the script then says why when it runs."""
    try:
        with io.open_code(os.path.abspath(script)) as source:
            return ast.parse(source.read())
    except (OSError, SyntaxError, ValueError):
        return None


def torch_imports(script: str) -> list[str]:
    """The torch modules `script` imports at its top level (in `try` blocks too), with what they load on first
    use (`IMPORTED_WITH`); none when it cannot be read or parsed."""
    tree = _parsed(script)
    if tree is None:
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


def calls_elastic_run(script: str) -> bool:
    """Whether `script` calls `elastic.run` (as `elastic.run(...)`, or a `run` imported from `elastic`): only such
    a script can be started before its round, in standby, since `elastic.run` waits there for the round's
    environment. One that calls it through a module of its own is not seen, and starts with its round."""
    tree = _parsed(script)
    if tree is None:
        return False
    names = {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == "elastic"
        for alias in node.names
        if alias.name == "run"
    }
    modules = {"elastic"} | {
        alias.asname
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
        if alias.name == "elastic" and alias.asname
    }
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id in names:
            return True
        if isinstance(func, ast.Attribute) and func.attr == "run" and isinstance(func.value, ast.Name):
            if func.value.id in modules:
                return True
    return False


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
