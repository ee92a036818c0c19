"""Training across machines, on one: two `torchrun` launchers with a c10d rendezvous on
localhost play two nodes (examples/multinode.py, HSDP over {'node': 2, 'gpu': 2}).

- the two-launcher run's losses equal the single-launcher run's (`torchrun
  --nproc-per-node 4`, same mesh, seed and data) bit for bit;
- the same with int8 all-gathers and reduce-scatters (sf.MixedPrecision's wire formats);
- SIGKILL one "node" (its launcher and its workers) mid-run: the other launcher fails fast
  with a message that says a peer is gone, and rerunning both launchers resumes from the
  last checkpoint and ends with the losses and parameters of an uninterrupted run;
- a frozen node (SIGSTOP) is caught by the collective timeout; a SIGTERM (scheduler) gets
  the same "rerun; training resumes from ..." message.

Launchers run in their own sessions with their output in a log file; every test kills what
it started in a `finally`, and waits by polling a condition against a deadline.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

import shardfn as sf

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "examples", "multinode.py")
ENV = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1")
ENV["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, ENV.get("PYTHONPATH")]))  # this checkout's shardfn
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
RUN_TIMEOUT_S = 240  # one launcher's whole run; a bound on a hang, far above the ~10-20 s it takes


def free_port() -> int:
    """A port nobody listens on now (the OS picks it: bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from /proc: torchrun starts each worker in a new
    session, so killing the launcher's process group leaves its workers running)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:  # exited meanwhile
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:  # field 4, after "(comm)"
                out.append(int(entry))
    return out


class Launcher:
    """One `torchrun` process (a "node"), in its own session, its output in a log file."""

    def __init__(self, tmp_path, name: str, torchrun_args: list, script_args: list):
        self.name, self.log = name, tmp_path / f"{name}.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([*TORCHRUN, *torchrun_args, SCRIPT, *script_args], cwd=ROOT, env=ENV,
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def text(self) -> str:
        return self.log.read_text()

    def wait(self, timeout: float = RUN_TIMEOUT_S) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"launcher {self.name} still running after {timeout} s:\n{self.text()[-3000:]}")

    def kill(self) -> None:
        """SIGKILL the launcher and its workers, as a machine that loses power would stop."""
        workers = _children(self.proc.pid)
        for pid in [self.proc.pid, *workers]:
            try:
                os.killpg(pid, signal.SIGKILL)  # each one leads its own session (see _children)
            except ProcessLookupError:
                pass
        self.proc.wait(30)

    def freeze(self) -> None:
        """SIGSTOP the launcher and its workers: a node that hangs (its connections stay open)."""
        for pid in [self.proc.pid, *_children(self.proc.pid)]:
            os.killpg(pid, signal.SIGSTOP)

    def ensure_dead(self) -> None:
        if self.proc.poll() is None:
            self.kill()


def wait_until(predicate, timeout: float, what: str, launchers=()):
    """Poll `predicate` until it holds (no sleep-for-timing: a deadline on a condition)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {n.name}:\n{n.text()[-2000:]}" for n in launchers)
            raise AssertionError(f"timed out after {timeout} s waiting for {what}\n{logs}")
        for n in launchers:
            if n.proc.poll() is not None and n.proc.returncode != 0:
                raise AssertionError(f"launcher {n.name} failed ({n.proc.returncode}) while waiting for {what}:\n"
                                     f"{n.text()[-3000:]}")
        time.sleep(0.05)  # the polling interval, not a timing assumption


def listening(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def start_two_nodes(tmp_path, tag: str, script_args: list, port: int) -> list[Launcher]:
    """Two launchers with one c10d rendezvous at localhost:`port`. Node a starts first and
    hosts the rendezvous store (the launcher whose host matches the endpoint and binds the
    port first serves it), so a test knows which node it kills."""
    common = ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
              "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", f"{tag}-{port}", "--max-restarts", "0"]
    a = Launcher(tmp_path, f"{tag}-node-a", common, script_args)
    try:
        wait_until(lambda: listening(port), 60, f"node a's rendezvous store on port {port}", [a])
        b = Launcher(tmp_path, f"{tag}-node-b", common, script_args)
    except BaseException:
        a.ensure_dead()
        raise
    return [a, b]


def run_two_nodes(tmp_path, tag: str, script_args: list) -> list[Launcher]:
    nodes = start_two_nodes(tmp_path, tag, script_args, free_port())
    try:
        for n in nodes:
            assert n.wait() == 0, f"launcher {n.name} failed:\n{n.text()[-4000:]}"
    finally:
        for n in nodes:
            n.ensure_dead()
    return nodes


def run_one_launcher(tmp_path, tag: str, script_args: list) -> Launcher:
    n = Launcher(tmp_path, tag, ["--standalone", "--nproc-per-node", "4"], ["--mesh", "2x2", *script_args])
    try:
        assert n.wait() == 0, f"launcher {n.name} failed:\n{n.text()[-4000:]}"
    finally:
        n.ensure_dead()
    return n


def losses(path) -> list[float]:
    with open(path) as f:
        return json.load(f)["losses"]


def assert_same_params(a, b):
    leaves = torch.utils._pytree.tree_leaves
    assert len(leaves(a)) == len(leaves(b)) > 0
    diffs = [(x - y).abs().max().item() for x, y in zip(leaves(a), leaves(b))]
    assert all(torch.equal(x, y) for x, y in zip(leaves(a), leaves(b))), f"max |diff| per leaf: {diffs}"


TINY = ["--tiny", "--quiet"]


# -- the example's helpers, in this process (fast) --------------------------------------


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("multinode_example", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_mesh_from_torchrun_layout_or_flag(example, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert example.mesh_shape(None) == {"node": 2, "gpu": 4}  # --nnodes 2 --nproc-per-node 4
    assert example.mesh_shape("1x8") == {"node": 1, "gpu": 8}
    with pytest.raises(SystemExit, match=r"--mesh 2x2 has 4 ranks but the job has 8 \(WORLD_SIZE\).\n"
                                         r"Fix: --mesh NODESxGPUS with NODES \* GPUS = 8"):
        example.mesh_shape("2x2")
    with pytest.raises(SystemExit, match=r"--mesh '2' is not NODESxGPUS.\nFix: e.g. --mesh 2x4"):
        example.mesh_shape("2")


def test_compression_flags_pass_through_only_when_given(example):
    mp = lambda *argv: example.mixed_precision(example.make_parser().parse_args(argv))  # noqa: E731
    assert mp() is None  # plain fp32: no MixedPrecision at all
    assert mp("--bf16") == sf.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    assert mp("--all-gather-dtype", "int8", "--reduce-scatter-dtype", "float8_e5m2", "--block-size", "256") == \
        sf.MixedPrecision(all_gather_dtype="int8", reduce_scatter_dtype=torch.float8_e5m2, block_size=256)
    assert mp("--all-gather-dtype", "bf16") == sf.MixedPrecision(all_gather_dtype=torch.bfloat16)
    with pytest.raises(SystemExit):  # argparse's "invalid choice", listing the choices
        mp("--all-gather-dtype", "int4")


def test_only_a_lost_peer_gets_the_restart_message(example):
    closed = RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:27009")
    assert example.lost_peer(closed)
    assert example.lost_peer(sf.CollectiveTimeoutError("all_gather ... waited more than 10 s on rank 0"))
    assert not example.lost_peer(RuntimeError("mat1 and mat2 shapes cannot be multiplied (8x32 and 64x32)"))
    assert not example.lost_peer(ValueError("Connection closed by peer"))  # only collectives' RuntimeErrors


# -- launchers ---------------------------------------------------------------------------


def simulate(tmp_path, *args) -> str:
    """`python examples/multinode.py`: the mesh simulated by threads of one process."""
    proc = subprocess.run([sys.executable, SCRIPT, *TINY, "--mesh", "2x2", *args], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


def test_simulated_run_resumes_from_its_checkpoint(tmp_path):
    """The resume logic without torchrun: a run cut short after step 6 (its later checkpoints
    deleted) continues from step_000006 and gives the uninterrupted losses."""
    ckpt = tmp_path / "ckpt"
    simulate(tmp_path, "--steps", "8", "--ckpt-every", "3", "--checkpoint-dir", str(ckpt),
             "--out", str(tmp_path / "straight.json"))
    assert sorted(os.listdir(ckpt)) == ["step_000003", "step_000006", "step_000008"]
    shutil.rmtree(ckpt / "step_000008")
    out = simulate(tmp_path, "--steps", "8", "--ckpt-every", "3", "--checkpoint-dir", str(ckpt),
                   "--out", str(tmp_path / "resumed.json"))
    assert f"resumed from {ckpt / 'step_000006'} (step 6)" in out
    with open(tmp_path / "resumed.json") as f:
        assert json.load(f)["resumed_at"] == 6
    assert losses(tmp_path / "resumed.json") == losses(tmp_path / "straight.json")


@pytest.mark.slow  # ~30 s: two launchers (4 workers), then one, then the simulated mesh (make test-all)
@pytest.mark.multiprocess
def test_two_launchers_equal_one_launcher(tmp_path):
    args = [*TINY, "--steps", "8"]
    run_two_nodes(tmp_path, "two", [*args, "--out", str(tmp_path / "two.json")])
    run_one_launcher(tmp_path, "one", [*args, "--out", str(tmp_path / "one.json")])
    simulate(tmp_path, "--steps", "8", "--out", str(tmp_path / "sim.json"))
    two, one, sim = (losses(tmp_path / f"{n}.json") for n in ("two", "one", "sim"))
    assert len(two) == 8 and two[-1] < two[0]  # it trained
    assert two == one == sim  # bit-identical: same ranks, same groups, same reduction order


@pytest.mark.slow  # ~40-70 s: two launchers, then one, then the fp32 reference
@pytest.mark.multiprocess
def test_compressed_two_launchers_equal_one_launcher(tmp_path):
    """int8 all-gathers and int8 reduce-scatters (sf.MixedPrecision, passed through by the
    example): the quantized computation is the same on both launches, so the losses are too,
    bit for bit; they differ from fp32's (the compression is in effect) by little, and the
    all-gathers and reduce-scatters move a quarter of fp32's bytes."""
    args = [*TINY, "--steps", "8"]
    int8 = ["--all-gather-dtype", "int8", "--reduce-scatter-dtype", "int8", "--block-size", "256"]
    run_two_nodes(tmp_path, "two", [*args, *int8, "--out", str(tmp_path / "two.json")])
    run_one_launcher(tmp_path, "one", [*args, *int8, "--out", str(tmp_path / "one.json")])
    run_one_launcher(tmp_path, "fp32", [*args, "--out", str(tmp_path / "fp32.json")])
    two, one, fp32 = (losses(tmp_path / f"{n}.json") for n in ("two", "one", "fp32"))
    with open(tmp_path / "two.json") as f:
        report = json.load(f)
    with open(tmp_path / "fp32.json") as f:
        report32 = json.load(f)
    mp = report["mixed_precision"]
    assert (mp["all_gather_dtype"], mp["reduce_scatter_dtype"], mp["block_size"]) == ("int8", "int8", "256")
    assert two == one
    assert two != fp32, "int8 gathers and reductions gave fp32's losses bit for bit: not compressed?"
    assert abs(two[-1] - fp32[-1]) < 0.02 * fp32[-1], (two[-1], fp32[-1])
    # rank 0's last step: int8 rows are S bytes + a float32 scale per 256 elements (the
    # all-gather's per leaf), fp32's 4 S (docs/howto/compressed-communication.md): 25.5 % here
    # for the in-node all-gathers, 25.4 % for the reduce-scatters; the gradient all-reduce
    # across nodes stays full precision (HSDP's choice)
    stats, stats32 = report["stats"], report32["stats"]
    for key in ("all_gather_bytes", "reduce_scatter_bytes"):
        assert 0.25 < stats[key] / stats32[key] < 0.26, (key, stats, stats32)
    assert stats["all_reduce_bytes"] == stats32["all_reduce_bytes"] > 0


@pytest.mark.slow  # ~70 s each: a reference run, a killed run and its restart
@pytest.mark.multiprocess
@pytest.mark.parametrize("dead, wire", [("worker-node", "fp32"), ("rendezvous-host", "fp32"), ("worker-node", "int8")])
def test_killed_node_fails_fast_and_restart_matches_uninterrupted_run(tmp_path, dead, wire):
    """`rendezvous-host`: the node that dies also served the c10d store the survivors' agent
    talks to; the survivor must still stop, not wait on the store. `int8`: compressed
    all-gathers and reduce-scatters resume bit-identically too (the encoding is a function
    of the restored master shards)."""
    steps, every = 24, 3
    args = [*TINY, "--steps", str(steps), "--ckpt-every", str(every), "--timeout", "30"]
    if wire == "int8":
        args += ["--all-gather-dtype", "int8", "--reduce-scatter-dtype", "int8", "--block-size", "256"]
    run_one_launcher(tmp_path, "straight", [*args, "--out", str(tmp_path / "straight.json"),
                                            "--params-out", str(tmp_path / "straight.pt")])

    ckpt = tmp_path / "ckpt"
    run = [*args, "--checkpoint-dir", str(ckpt), "--out", str(tmp_path / "killed.json"),
           "--params-out", str(tmp_path / "killed.pt")]
    port = free_port()
    a, b = start_two_nodes(tmp_path, "killed", run, port)
    try:
        first = os.path.join(str(ckpt), f"step_{every:06d}")
        wait_until(lambda: sf.checkpoint.latest(str(ckpt)) is not None, RUN_TIMEOUT_S, f"{first}", [a, b])
        victim, survivor = (b, a) if dead == "worker-node" else (a, b)
        victim.kill()  # the node loses power
        killed_at = time.monotonic()
        rc = survivor.wait(90)  # --timeout 30 bounds it; a closed connection ends it at once
        failed_after = time.monotonic() - killed_at
    finally:
        a.ensure_dead()
        b.ensure_dead()
    log = survivor.text()
    assert rc != 0, log[-3000:]
    # The workers see the closed connections ("lost a peer"), unless their launcher, which
    # lost the rendezvous store with the host node, SIGTERMs them first ("stopped by SIGTERM").
    said = "lost a peer mid-step" in log or (dead == "rendezvous-host" and "was stopped by SIGTERM" in log)
    assert said and "Fix: rerun the same command on every node; training resumes from " in log, log[-4000:]
    assert failed_after < 60, failed_after
    print(f"{dead} killed: the survivor failed {failed_after:.1f} s later")
    assert not (tmp_path / "killed.json").exists()  # it was killed mid-run, before the end

    resumed = sf.checkpoint.latest(str(ckpt))
    run_two_nodes(tmp_path, "restart", run)  # the same command, a fresh rendezvous
    with open(tmp_path / "killed.json") as f:
        report = json.load(f)
    assert 0 < report["resumed_at"] < steps and resumed.endswith(f"step_{report['resumed_at']:06d}")
    assert report["losses"] == losses(tmp_path / "straight.json")
    assert_same_params(torch.load(tmp_path / "killed.pt"), torch.load(tmp_path / "straight.pt"))


@pytest.mark.slow  # ~40 s
@pytest.mark.multiprocess
def test_frozen_node_fails_the_others_within_the_timeout(tmp_path):
    """A node that stops responding but keeps its connections open (SIGSTOP: a hung driver, a
    swapping host) is only noticed by the collective timeout: the survivors must stop within
    `--timeout` (plus start-up of the error path), with the same readable message."""
    timeout = 10
    ckpt = tmp_path / "ckpt"
    run = [*TINY, "--steps", "200", "--ckpt-every", "2", "--timeout", str(timeout), "--checkpoint-dir", str(ckpt)]
    a, b = start_two_nodes(tmp_path, "frozen", run, free_port())
    try:
        wait_until(lambda: sf.checkpoint.latest(str(ckpt)) is not None, RUN_TIMEOUT_S, "the first checkpoint", [a, b])
        b.freeze()
        frozen_at = time.monotonic()
        rc = a.wait(timeout * 6)
        failed_after = time.monotonic() - frozen_at
    finally:
        b.ensure_dead()  # SIGKILL ends stopped processes too
        a.ensure_dead()
    log = a.text()
    assert rc != 0, log[-3000:]
    assert "lost a peer mid-step (CollectiveTimeoutError" in log, log[-4000:]
    assert "rerun the same command on every node" in log
    print(f"node b frozen: node a failed {failed_after:.1f} s later (--timeout {timeout})")
    assert failed_after < timeout * 4, failed_after


@pytest.mark.slow  # ~15 s
@pytest.mark.multiprocess
def test_sigterm_from_the_scheduler_says_how_to_resume(tmp_path):
    """SIGTERM to a launcher (how SLURM ends a job, and how a launcher that lost its
    rendezvous stops its ranks): every rank says it was stopped and where training resumes."""
    ckpt = tmp_path / "ckpt"
    n = Launcher(tmp_path, "term", ["--standalone", "--nproc-per-node", "2"],
                 [*TINY, "--mesh", "1x2", "--steps", "500", "--ckpt-every", "2", "--checkpoint-dir", str(ckpt)])
    try:
        wait_until(lambda: sf.checkpoint.latest(str(ckpt)) is not None, RUN_TIMEOUT_S, "the first checkpoint", [n])
        n.proc.send_signal(signal.SIGTERM)  # torchrun passes it on to its workers
        rc = n.wait(60)
    finally:
        n.ensure_dead()
    log = n.text()
    assert rc != 0
    for rank in (0, 1):
        assert f"multinode.py: rank {rank} was stopped by SIGTERM" in log, log[-4000:]
    assert f"training resumes from {ckpt}{os.sep}step_" in log
