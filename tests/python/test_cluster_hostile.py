"""Hostile input to the cluster simulator (issue 15), Ctrl-C, and a torch-free startup."""

from __future__ import annotations

import gzip
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hemiola import _C
from hemiola.cli import main
from hemiola.cluster import ClusterConfig, PolicyConfig, WorkloadConfig, simulate
from hemiola.cluster.api import load_models, make_jobs, run_jobs

C = _C.cluster
HEADER = "timestamp,duration,num_gpus\n"
ROW = "2017-10-09 07:01:55,60,1\n"


def _write(tmp_path: Path, text: str | bytes, name: str = "t.csv") -> str:
    p = tmp_path / name
    if isinstance(text, bytes):
        p.write_bytes(text)
    else:
        p.write_text(text)
    return str(p)


def _cli_error(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """Runs ``hemiola cluster simulate ARGS``; expects exit status 2, returns stderr."""
    rc = main(["cluster", "simulate", "--fidelity", "iteration", *args])
    captured = capsys.readouterr()
    assert rc == 2, captured.out
    assert captured.out == ""
    return captured.err


@pytest.mark.parametrize(
    ("body", "message"),
    [
        # Used to overflow std::llround into a 1-iteration job (mean JCT 79 ms, exit 0).
        ("2017-10-09 07:01:55,1e300,1\n", "t.csv line 2: column 'duration' is out of range"),
        # Used to hang the task level (1.6e13 iterations).
        ("2017-10-09 07:01:55,1e12,1\n", "t.csv line 2: column 'duration' is out of range"),
        (
            "2021-02-30 07:01:55,60,1\n",
            "t.csv line 2: column 'timestamp': timestamp '2021-02-30 07:01:55' is not a real date",
        ),
        (
            "2017-10-09 07:01:55,60,0x10\n",
            "t.csv line 2: column 'num_gpus' must be a positive decimal integer, got '0x10'",
        ),
        ("2017-10-09 07:01:55,0x3c,1\n", "t.csv line 2: column 'duration' is not a number"),
        ("", "t.csv: no data rows (only a header)"),
    ],
)
def test_hostile_trace_rows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], body: str, message: str
) -> None:
    err = _cli_error(capsys, "--trace", _write(tmp_path, HEADER + body))
    assert message in err


def test_hostile_iterations(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(
        tmp_path,
        "timestamp,duration,num_gpus,iterations\n2017-10-09 07:01:55,0,1,9223372036854775807\n",
    )
    err = _cli_error(capsys, "--trace", path, "--fidelity", "task")
    assert "t.csv line 2: column 'iterations' must be in 1..1000000000" in err
    # Built by hand through the native API, the same job is refused by simulate().
    job = C.JobSpec()
    job.iterations = 2**63 - 1
    with pytest.raises(ValueError, match="iterations must be in 1..1000000000"):
        C.simulate(C.ClusterSpec(), C.builtin_models(), [job], C.PolicyConfig())


def test_byte_order_mark_is_accepted(tmp_path: Path) -> None:
    path = _write(tmp_path, ("\ufeff" + HEADER + ROW).encode("utf-8"))
    s = simulate(
        WorkloadConfig(kind="trace", trace_path=path),
        ClusterConfig(),
        PolicyConfig(fidelity="iteration"),
    )
    assert s.jobs == 1 and s.mean_jct_ms > 59_000


def test_binary_file_error_names_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A compressed trace given by mistake used to fail with a bare UnicodeDecodeError.
    path = _write(tmp_path, gzip.compress((HEADER + ROW * 100).encode()), "trace.csv.gz")
    err = _cli_error(capsys, "--trace", path)
    assert f"{path} line 1: not a UTF-8 text CSV file (byte 0x1f at column 1)" in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--first-row", "3"], "t.csv: first_row 3 is past the last data row (the file has 3"),
        (["--max-rows", "0"], "max_rows must be >= 1"),
        (["--max-rows", "-5"], "max_rows must be >= 1"),  # not "all rows"
        (["--first-row", "-1"], "first_row must be >= 0"),
    ],
)
def test_empty_selections_are_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    err = _cli_error(capsys, "--trace", _write(tmp_path, HEADER + ROW * 3), *args)
    assert message in err


def test_native_loader_refuses_negative_max_rows(tmp_path: Path) -> None:
    path = _write(tmp_path, HEADER + ROW * 3)
    with pytest.raises(ValueError, match="max_rows must be > 0 \\(or -1 for all rows\\), got -5"):
        C.load_trace(path, C.builtin_models(), C.ClusterSpec(), max_rows=-5)
    assert len(C.load_trace(path, C.builtin_models(), C.ClusterSpec(), max_rows=-1)) == 3


def test_empty_paper_workload_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert "jobs must be >= 1, got 0" in _cli_error(capsys, "--jobs", "0")
    with pytest.raises(ValueError, match="simulate: no jobs"):
        C.simulate(C.ClusterSpec(), C.builtin_models(), [], C.PolicyConfig())


# A valid job that the task level would take hours to simulate: a billion
# iterations of VGG-16 on 8 GPUs (two nodes, so every iteration all-reduces).
ENDLESS = "timestamp,duration,num_gpus,model,iterations\n2017-10-09 07:01:55,0,8,vgg16,1000000000\n"


def test_should_stop_cancels_a_run(tmp_path: Path) -> None:
    workload = WorkloadConfig(kind="trace", trace_path=_write(tmp_path, ENDLESS))
    models = load_models(workload)
    jobs = make_jobs(workload, ClusterConfig(), models)
    calls = []

    def stop() -> bool:
        calls.append(time.perf_counter())
        return len(calls) == 5

    start = time.perf_counter()
    with pytest.raises(C.Interrupted, match="simulation interrupted after"):
        run_jobs(jobs, models, ClusterConfig(), PolicyConfig(fidelity="task"), should_stop=stop)
    assert len(calls) == 5
    assert time.perf_counter() - start < 5


def _sigint(tmp_path: Path, script: str, after_s: float, running: str,
            timeout_s: float = 10) -> tuple[int, str, str, float]:
    """Runs `script` (which prints "ready" first), sends it SIGINT `after_s`
    later, checking it still runs (`running` says what, should it not); returns
    (exit status, the rest of stdout, stderr, seconds from SIGINT to exit).
    A terminal's Ctrl-C: Python keeps SIGINT ignored when its parent ignored it
    (as a shell does for a background job, e.g. `bash tests/run.sh &`), so the
    script installs the default handler itself."""
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        time.sleep(after_s)
        assert proc.poll() is None, running
        sent = time.perf_counter()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=timeout_s)
        return proc.returncode, out, err, time.perf_counter() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _interrupt(tmp_path: Path, command: list[str]) -> tuple[int, str, float]:
    """Starts ``hemiola cluster COMMAND`` on the endless workload, sends SIGINT once it
    runs, returns (exit status, stderr, seconds from SIGINT to exit)."""
    script = (
        "import signal, sys\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "from hemiola.cli import main\n"
        "print('ready', flush=True)\n"
        f"sys.exit(main({['cluster', *command, '--trace', _write(tmp_path, ENDLESS)]!r}))\n"
    )
    # 1.5 s: well inside the native loop (loading one row takes microseconds)
    rc, _, err, seconds = _sigint(tmp_path, script, 1.5, "the simulation ended by itself")
    return rc, err, seconds


def test_ctrl_c_stops_simulate(tmp_path: Path) -> None:
    rc, err, seconds = _interrupt(tmp_path, ["simulate", "--fidelity", "task"])
    assert rc == 130, err
    assert "hemiola cluster simulate: interrupted (Ctrl-C)" in err
    assert seconds < 3


def test_ctrl_c_stops_compare(tmp_path: Path) -> None:
    # The runs are on pool threads, which signals do not reach.
    rc, err, seconds = _interrupt(
        tmp_path,
        [
            "compare",
            "--placements",
            "first-fit,lwf",
            "--kappas",
            "1",
            "--comms",
            "srsf:1",
            "--seeds",
            "2",
            "--no-progress",
            "--workers",
            "2",
            "--out",
            str(tmp_path / "out"),
        ],
    )
    assert rc == 130, err
    assert "hemiola cluster compare: interrupted (Ctrl-C)" in err
    assert seconds < 3
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "command",
    [
        ["simulate", "--jobs", "10"],
        [
            "compare",
            "--jobs",
            "10",
            "--placements",
            "first-fit",
            "--comms",
            "srsf:1",
            "--seeds",
            "1",
            "--no-progress",
            "--out",
            "out",
        ],
    ],
)
def test_cluster_commands_do_not_import_torch(tmp_path: Path, command: list[str]) -> None:
    # -X importtime lists every module imported, on stderr, one per line.
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "hemiola", "cluster", *command],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    imported = {
        line.rsplit("|", 1)[-1].strip()
        for line in proc.stderr.splitlines()
        if line.startswith("import time:")
    }
    assert "hemiola.cluster.cli" in imported  # the listing is real
    assert not {m for m in imported if m == "torch" or m.startswith("torch.")}


def test_ctrl_c_stops_a_trace_while_it_loads(tmp_path: Path) -> None:
    """A trace of millions of rows: Ctrl-C during the load (not after it)."""
    rows = 4_000_000
    trace = tmp_path / "big.csv"
    with trace.open("w") as f:
        f.write("timestamp,duration,num_gpus\n")
        row = "2017-10-09 07:01:55,60,1\n"
        for _ in range(rows // 100_000):
            f.write(row * 100_000)
    script = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "from hemiola import _C\n"
        "c = _C.cluster\n"
        "print('ready', flush=True)\n"
        "start = time.perf_counter()\n"
        "try:\n"
        f"    c.load_trace({str(trace)!r}, c.builtin_models(), c.ClusterSpec())\n"
        "    print('loaded', time.perf_counter() - start, flush=True)\n"
        "except KeyboardInterrupt:\n"
        "    print('interrupted', time.perf_counter() - start, flush=True)\n"
    )
    _, out, err, waited = _sigint(tmp_path, script, 0.3, "the load ended by itself",
                                  timeout_s=60)
    assert out.startswith("interrupted"), out + err  # not "loaded": it stopped mid-file
    assert waited < 2, waited


def test_ctrl_c_while_an_error_prints_exits_130(tmp_path: Path) -> None:
    """Ctrl-C while a command writes its error (a terminal that does not keep up):
    status 130 and one line, not a KeyboardInterrupt traceback and -2."""
    # argparse echoes an unknown argument; at 100 KB its message overflows the
    # pipe (64 KiB) this test does not read, so the write blocks until SIGINT.
    script = (
        "import signal, sys\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "from hemiola.cli import main\n"
        "print('ready', flush=True)\n"
        "sys.exit(main(['cluster', 'simulate', '--bogus=' + 'x' * 100_000]))\n"
    )
    rc, _, err, _ = _sigint(tmp_path, script, 1.0, "the error was written without blocking")
    assert rc == 130, err[-2000:]
    assert "Traceback" not in err
    assert err.rstrip().endswith("hemiola: interrupted (Ctrl-C)")
