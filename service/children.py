"""The service's child processes, started and ended one way: the runner of each model (``service.runner``), the
dry-run workers (``service.engine.dryrun``) and the grammar zygote (``service.grammar.worker``).

``Child`` starts ``python -m MODULE ARGS`` with the environment its owner gives (``service.engine.native.child_env``
for the children that load llama.cpp) and the descriptors it passes (one end of a socket pair); a thread reads the
child's stderr, keeping its last lines for the reason of a death and, where asked, writing them to this process's
stderr; it ends one way: wait up to a grace for the child to exit (after its owner asked it to), then SIGKILL, then
reap. What is said to the child (pickles, JSON lines, fds), time limits on the answers, and restarts are the owner's:
a restart is a new ``Child``. sizing's mtmd probe (``sizing.probe.mtmd``: ``subprocess.run`` with a timeout) is the
one child outside this, in a package that imports nothing of the service.
"""

from __future__ import annotations

import collections
import logging
import subprocess
import sys
import threading
from typing import IO, Any, Mapping, Sequence

log = logging.getLogger(__name__)

KILL_WAIT_S = 10.0
"""How long a SIGKILLed child may take to be reaped before it is left to the OS (a kill that does not take)."""


class Child:
    """One child process of the service (see the module docstring)."""

    def __init__(self, module: str, args: Sequence[str] = (), *, name: str, env: Mapping[str, str] | None = None,
                 pass_fds: Sequence[int] = (), stdin: bool = False, stdout: bool = False, text: bool = False,
                 forward_stderr: bool = False, tail_lines: int = 20) -> None:
        """``stdin``/``stdout``: pipes to the child (else /dev/null); ``text``: those pipes in text mode, line
        buffered. Raises ``OSError`` when the process cannot be started."""
        self.name = name
        self.proc: subprocess.Popen[Any] = subprocess.Popen(
            [sys.executable, "-m", module, *args], pass_fds=tuple(pass_fds), env=dict(env) if env is not None else None,
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE if stdout else subprocess.DEVNULL, stderr=subprocess.PIPE,
            text=text, bufsize=1 if text else -1)
        self.pid = self.proc.pid
        self.tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
        """The child's last lines on stderr."""
        self._forward = forward_stderr
        self._text = text
        self._stderr = threading.Thread(target=self._read_stderr, name=f"{name[:40]}-stderr", daemon=True)
        self._stderr.start()

    @property
    def stdin(self) -> IO[Any] | None:
        return self.proc.stdin

    @property
    def stdout(self) -> IO[Any] | None:
        return self.proc.stdout

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def _read_stderr(self) -> None:
        stream = self.proc.stderr
        assert stream is not None
        for raw in iter(stream.readline, "" if self._text else b""):
            line = (raw if isinstance(raw, str) else raw.decode("utf-8", "replace")).rstrip("\n")
            self.tail.append(line)
            if self._forward:
                try:
                    sys.stderr.write(line + "\n")
                except (OSError, ValueError):  # this process's stderr closed (shutdown)
                    pass

    def alive(self) -> bool:
        return self.proc.poll() is None

    def exited(self) -> bool:
        """Whether the child has ended, a zombie not reaped yet included (``Popen.poll`` cannot tell while another
        thread is in ``wait``)."""
        try:
            with open(f"/proc/{self.pid}/stat", encoding="ascii", errors="replace") as f:
                return f.read().rsplit(")", 1)[-1].split()[0] in ("Z", "X")
        except FileNotFoundError:
            return True
        except (OSError, IndexError):  # no /proc here
            return self.proc.poll() is not None

    def last_lines(self, n: int = 3) -> str:
        """The end of the child's stderr (where llama.cpp writes why it aborted), on one line."""
        lines = [ln for ln in self.tail if ln.strip()][-n:]
        return " | ".join(lines)[-600:]

    def reap(self) -> int:
        """Wait until the OS has reaped the child (its stderr read to the end); its exit status."""
        rc = self.proc.wait()
        self._stderr.join(timeout=5)
        return rc

    def end(self, grace_s: float) -> int | None:
        """Wait up to ``grace_s`` for the child to exit (its owner asked it to), then kill it; reaped."""
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            log.warning("%s (pid %d) did not exit within %g s: killed", self.name, self.pid, grace_s)
        return self.kill()

    def kill(self) -> int | None:
        """SIGKILL unless it has exited, and reap it; its exit status (None when the kill did not take)."""
        if self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            rc = self.proc.wait(timeout=KILL_WAIT_S)
        except subprocess.TimeoutExpired:  # pragma: no cover - a kill that does not take
            return None
        self._stderr.join(timeout=5)
        return rc
