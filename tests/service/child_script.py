"""A child for tests/service/test_children.py, run as ``python -m tests.service.child_script MODE ...``."""

import signal
import sys
import time

if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "echo":  # one line in, the same line out, upper-cased
        sys.stdout.write(sys.stdin.readline().upper())
        sys.stdout.flush()
    elif mode == "stderr":  # N numbered lines to stderr, then exit with RC
        for i in range(int(sys.argv[2])):
            sys.stderr.write(f"line {i}\n")
        sys.stderr.flush()
        sys.exit(int(sys.argv[3]))
    elif mode == "stubborn":  # ignores SIGTERM and never exits by itself
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        sys.stderr.write("ready\n")
        sys.stderr.flush()
        while True:
            time.sleep(1)
