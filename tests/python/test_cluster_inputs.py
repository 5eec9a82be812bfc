"""Bad input gives a clear error naming the row; the Philly trace when present."""

from __future__ import annotations

from pathlib import Path

import pytest

from hemiola import _C
from hemiola.cluster import ClusterConfig, PolicyConfig, WorkloadConfig, simulate

C = _C.cluster
HEADER = "timestamp,duration,num_gpus,gpu_time,cluster\n"
PHILLY = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "traces" / "philly.csv"


def _trace(tmp_path: Path, body: str) -> str:
    p = tmp_path / "t.csv"
    p.write_text(HEADER + body)
    return str(p)


def _run_trace(path: str, **cluster: int) -> object:
    return simulate(WorkloadConfig(kind="trace", trace_path=path), ClusterConfig(**cluster),
                    PolicyConfig(fidelity="iteration"))


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("2017-10-09 07:01:55,60,1,60,x\n2017-10-09 7:01,60,1,60,x\n",
         "t.csv line 3: column 'timestamp'"),
        ("2017-10-09 07:01:55,-60,1,60,x\n", "t.csv line 2: column 'duration' is negative"),
        ("2017-10-09 07:01:55,sixty,1,60,x\n", "t.csv line 2: column 'duration' is not a number"),
        ("2017-10-09 07:01:55,60,-4,60,x\n", "t.csv line 2: column 'num_gpus'"),
        ("2017-10-09 07:01:55,60\n", "t.csv line 2: expected 5 fields, got 2"),
        ("2017-10-09 07:01:55,60,1,60,x\n2017-10-09 07:01:55,60,65,60,x\n",
         "t.csv line 3: needs 65 GPUs but the cluster has only 64"),
    ],
)
def test_malformed_trace_rows(tmp_path: Path, body: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        _run_trace(_trace(tmp_path, body))


def test_trace_header_naming_a_column_twice_is_refused_at_line_1(tmp_path: Path) -> None:
    p = tmp_path / "t.csv"
    p.write_text("timestamp,duration,num_gpus,duration\n2017-10-09 07:01:55,60,1,60\n")
    with pytest.raises(ValueError, match="t.csv line 1: column 'duration' appears twice"):
        _run_trace(str(p))


def test_trace_unknown_model_names_the_row(tmp_path: Path) -> None:
    p = tmp_path / "jobs.csv"
    p.write_text("timestamp,duration,num_gpus,model,iterations\n"
                 "2017-10-09 07:00:00,0,8,vgg16,10\n"
                 "2017-10-09 07:00:05,0,2,bert,10\n")
    with pytest.raises(ValueError, match="jobs.csv line 3: column 'model': unknown model 'bert'"):
        _run_trace(str(p))


def test_trace_as_job_list(tmp_path: Path) -> None:
    # An explicit job list: 8-GPU VGG-16 for 10 iterations, alone on 2 nodes.
    p = tmp_path / "jobs.csv"
    p.write_text("timestamp,duration,num_gpus,model,iterations\n2017-10-09 07:00:00,0,8,vgg16,10\n")
    s = simulate(WorkloadConfig(kind="trace", trace_path=str(p)), ClusterConfig(),
                 PolicyConfig("lwf:4", "srsf:1", "task"))
    assert s.mean_jct_ms == pytest.approx(10 * (90 + 526.4 * 0.856))


def test_missing_trace_file() -> None:
    with pytest.raises(ValueError, match="cannot open trace file '/no/such.csv'"):
        _run_trace("/no/such.csv")


def test_models_file(tmp_path: Path) -> None:
    good = tmp_path / "m.csv"
    good.write_text("name,size_mb,forward_ms,backward_ms,memory_mb\nbert,1300,80,160,9000\n")
    s = simulate(WorkloadConfig(jobs=10, models_path=str(good)), ClusterConfig(), PolicyConfig())
    assert s.jobs == 10
    bad = tmp_path / "bad.csv"
    bad.write_text("name,size_mb,forward_ms,backward_ms,memory_mb\nok,1,1,1,1\nneg,-5,1,1,1\n")
    with pytest.raises(ValueError, match="bad.csv line 3: model 'neg': size_mb"):
        simulate(WorkloadConfig(models_path=str(bad)))


def test_unknown_model_and_bad_policies() -> None:
    with pytest.raises(ValueError, match="unknown model 'gpt'"):
        C.find_model(C.builtin_models(), "gpt")
    with pytest.raises(ValueError, match="unknown placement 'best-fit'"):
        simulate(policy=PolicyConfig(placement="best-fit"))
    with pytest.raises(ValueError, match="unknown communication policy 'fifo'"):
        simulate(policy=PolicyConfig(comm="fifo"))
    with pytest.raises(ValueError, match="workload kind"):
        WorkloadConfig(kind="philly")


def test_job_wider_than_cluster() -> None:
    # The paper workload has 32-GPU jobs; a 4 x 4 cluster cannot hold them.
    with pytest.raises(ValueError, match="needs 32 GPUs but the cluster has only 16"):
        simulate(WorkloadConfig(jobs=160, seed=0), ClusterConfig(nodes=4))


@pytest.mark.skipif(not PHILLY.exists(), reason="Philly trace not present")
def test_philly_slice_iteration_level() -> None:
    models = list(C.builtin_models())
    cluster = C.ClusterSpec()
    cluster.nodes = 512
    jobs = list(C.load_trace(str(PHILLY), models, cluster, seed=0, first_row=1000,
                             max_rows=3000))
    assert len(jobs) == 3000
    assert jobs[0].arrival_ms == 0.0
    assert all(a.arrival_ms <= b.arrival_ms for a, b in zip(jobs, jobs[1:]))
    r = C.simulate(cluster, models, jobs, C.PolicyConfig("lwf:4", "ada-srsf", "iteration"))
    for spec, res in zip(jobs, r.jobs):
        m = models[spec.model]
        expected = m.size_mb * spec.iterations if res.multi_node else 0.0
        assert res.transferred_mb == pytest.approx(expected, rel=1e-9, abs=1e-6)
        assert res.finish_ms >= spec.arrival_ms


@pytest.mark.skipif(not PHILLY.exists(), reason="Philly trace not present")
def test_philly_job_alone_runs_for_its_duration() -> None:
    # Row 1 of the file: 66 s on 1 GPU. Alone, the job takes its recorded
    # duration to within half an iteration.
    models = list(C.builtin_models())
    jobs = list(C.load_trace(str(PHILLY), models, C.ClusterSpec(), seed=0, max_rows=1))
    r = C.simulate(C.ClusterSpec(), models, jobs, C.PolicyConfig(fidelity="iteration"))
    m = models[jobs[0].model]
    assert abs(r.jobs[0].jct_ms - 66_000) <= (m.forward_ms + m.backward_ms) / 2 + 1e-9
