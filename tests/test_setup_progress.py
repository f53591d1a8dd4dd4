"""tools/progress, the wrapper that keeps setup's long steps from looking like a hang (llama.cpp's compile through
``pip wheel -v``, vLLM's wheel, apt-get): build lines as ``[ NN%]`` with the time since the start, a line when
nothing was said for a while, the rest kept for a failure's report and the command's exit status passed on."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "progress"

BUILD = r"""
echo 'Building wheel for llama-cpp-python (pyproject.toml): started'
echo '  Running command Building wheel for llama-cpp-python (pyproject.toml)'
echo '  *** Configuring CMake...'
echo '  -- The C compiler identification is GNU 12.2.0'
echo '[ 12%] Building C object vendor/llama.cpp/ggml/src/CMakeFiles/ggml-base.dir/ggml.c.o'
echo 'cc1: note: a warning nobody reads'
sleep 1.2
echo '[41/210] Building CXX object vendor/llama.cpp/src/CMakeFiles/llama.dir/llama-model.cpp.o'
echo '[42/210] /usr/bin/g++ -DGGML_USE_CPU -DLLAMA_BUILD -I/tmp/pip-wheel-x/include -O3 -o vendor/llama.cpp/src/CMakeFiles/llama.dir/llama-vocab.cpp.o -c /tmp/pip-wheel-x/vendor/llama.cpp/src/llama-vocab.cpp'
echo '[210/210] : && /usr/bin/g++ -fPIC -O3 -shared -Wl,-soname,libllama.so -o vendor/llama.cpp/bin/libllama.so a.o b.o && :'
echo '  *** Created llama_cpp_python-0.3.36-cp311-cp311-linux_x86_64.whl'
"""
SHOWN = r"^\s*(\*\*\* |Building wheel|Created wheel|Successfully|ERROR)"


def run(*args: str, script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(TOOL), *args, "--", "bash", "-c", script], capture_output=True,
                          text=True, timeout=60)


def test_build_lines_and_steps_are_shown_with_the_time_and_the_rest_is_not() -> None:
    done = run("--label", "llama-wheel", "--only", SHOWN, "--every", "0.3", script=BUILD)
    assert done.returncode == 0 and done.stdout == ""
    lines = done.stderr.splitlines()
    assert all(line.startswith("llama-wheel ") and line.split(" ")[1].endswith("s:") for line in lines), lines
    assert lines[0].startswith("llama-wheel 0s: running bash -c")
    said = [line.split(": ", 1)[1] for line in lines[1:]]
    assert "[ 12%] Building C object vendor/llama.cpp/ggml/src/CMakeFiles/ggml-base.dir/ggml.c.o" in said
    assert "[ 19%] 41/210 Building CXX object vendor/llama.cpp/src/CMakeFiles/llama.dir/llama-model.cpp.o" in said
    # A verbose build's compiler commands, as the file each makes.
    assert "[ 20%] 42/210 compiling llama-vocab.cpp.o" in said and "[100%] 210/210 linking libllama.so" in said
    assert "  *** Configuring CMake..." in said and any("Created llama_cpp_python" in s for s in said)
    assert not any("compiler identification" in s or "cc1: note" in s for s in said), "the rest stays quiet"
    # Nothing came for 1.2 s, more than --every: a line said it was still running, and what it had reached.
    beats = [s for s in said if s.startswith("still running")]
    assert beats and beats[0] == "still running, last: [ 12%] Building C object " \
        "vendor/llama.cpp/ggml/src/CMakeFiles/ggml-base.dir/ggml.c.o", said
    assert said[-1].startswith("done in ")


def test_a_failure_prints_the_lines_kept_and_passes_its_status_on() -> None:
    done = run("--label", "fetch-vllm-events", "--only", "^Saved", script="echo 'Collecting vllm==0.34.0'; "
               "echo 'ERROR: No matching distribution found for vllm==0.34.0' >&2; exit 3")
    assert done.returncode == 3
    assert "fetch-vllm-events: the command failed (exit 3); its last 2 lines:" in done.stderr
    assert done.stderr.rstrip().endswith("Collecting vllm==0.34.0\nERROR: No matching distribution found for "
                                         "vllm==0.34.0")


def test_without_a_filter_every_line_is_shown() -> None:
    done = run("--label", "install-browser", script="echo 'Get:1 http://deb.debian.org chromium'; echo 'Setting up x'")
    said = [line.split(": ", 1)[1] for line in done.stderr.splitlines()]
    assert said[1:3] == ["Get:1 http://deb.debian.org chromium", "Setting up x"], said
