"""Faults (deepcompile/faults/, docs/faults.md): a rank that raises, is killed or freezes makes
every other rank exit naming it within ``fault_tolerance.timeout_s``; a rank killed during
``save_checkpoint`` leaves the previous checkpoint and ``latest`` loadable; torchrun's
``--max-restarts`` resumes from ``latest`` and ends bitwise where an uninterrupted run ends.

The process tests start real processes (``_harness/fault_worker.py``, torchrun for the example)
that die, raise and freeze; the pure logic (judging peers' records, the alarm, which errors are
echoes of another rank's failure) is tested in-process first."""

from __future__ import annotations

import io
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from _harness.multiproc import require_world_size, run_distributed
from _harness.paths import ROOT

EXIT = 75  # deepcompile.faults.PEER_FAILED_EXIT_CODE; the tests also check the constant
SLACK_S = 20.0  # start-up of a loaded 2-core CI machine is not the watchdog's delay; the bound stays finite


# ---- the logic, in-process ----------------------------------------------------------------------


def _status(state="alive", phase="backward", step=3, beat=1, pid=None, machine="", error=""):
    from deepcompile.faults.status import RankStatus

    return RankStatus(state=state, phase=phase, step=step, beat=beat, pid=pid or os.getpid(), machine=machine,
                      error=error)


def test_judge_names_a_silent_a_failed_and_a_vanished_rank_and_leaves_a_finished_one():
    from deepcompile.faults.status import PeerJudge, machine_id

    judge = PeerJudge(timeout_s=10.0, started=0.0, machine=machine_id())
    assert judge.observe(1, _status(beat=1), now=1.0) is None
    assert judge.observe(1, _status(beat=1), now=10.5) is None  # 9.5 s without a beat: not yet
    cause = judge.observe(1, _status(beat=1), now=11.5)
    assert cause.startswith("rank 1 stopped answering during backward of step 3: no heartbeat for 10.5 s"), cause
    assert judge.observe(1, _status(beat=2), now=12.0) is None  # it beat again
    assert judge.observe(2, _status(state="failed", phase="forward", step=5, error="ValueError: x"), 1.0) == \
        "rank 2 failed during forward of step 5: ValueError: x"
    assert judge.observe(3, _status(state="done"), now=100.0) is None
    assert judge.observe(4, None, now=9.0) is None
    assert "rank 4 never reported" in judge.observe(4, None, now=10.5)
    # A process of this machine that has ended: reported at once, without waiting for the timeout.
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    cause = judge.observe(5, _status(pid=ended.pid, machine=machine_id()), now=1.0)
    assert cause.startswith(f"rank 5 died during backward of step 3: its process (pid {ended.pid}) is gone"), cause
    # Another machine's pid says nothing here.
    assert judge.observe(6, _status(pid=ended.pid, machine="elsewhere"), now=1.0) is None


def _watchdog(store, rank, timeout_s, exits, err):
    from deepcompile.faults.watchdog import FaultWatchdog

    return FaultWatchdog(store, "unit", rank, 2, timeout_s, exit_process=exits.append, stderr=err)


def _wait_for(condition, limit_s=20.0):
    deadline = time.monotonic() + limit_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


def test_a_rank_whose_peer_fell_silent_exits_naming_it_and_raises_the_alarm():
    from deepcompile.faults import PEER_FAILED_EXIT_CODE

    assert PEER_FAILED_EXIT_CODE == EXIT
    store, exits, err = dist.HashStore(), [], io.StringIO()
    peer = _watchdog(store, 1, 1.0, [], io.StringIO())
    peer.enter("save_checkpoint", 7)
    peer._publish()  # rank 1 beats once, then falls silent (its threads never start)
    watchdog = _watchdog(store, 0, 1.0, exits, err).start()
    watchdog.enter("step", 7)
    assert _wait_for(lambda: exits), "the watchdog never gave up on the silent rank"
    assert exits == [EXIT]
    assert "rank 1 stopped answering during save_checkpoint of step 7" in err.getvalue()
    assert "Rank 0 (in step of step 7) exits with code 75" in err.getvalue()
    assert store.get("deepcompile/faults/unit/alarm").decode().startswith("rank 1 stopped answering")


def test_a_finished_rank_raises_no_alarm_and_a_failure_is_reported_from_the_alarm():
    from deepcompile.faults.status import DONE, RankStatus

    store, exits, err = dist.HashStore(), [], io.StringIO()
    finished = _watchdog(store, 1, 1.0, [], io.StringIO()).start()
    watchdog = _watchdog(store, 0, 1.0, exits, err).start()
    finished.stop()  # "done": silent from now on, and no alarm for it
    own_key = "deepcompile/faults/unit/0"
    beats_before = RankStatus.decode(store.get(own_key)).beat
    time.sleep(2.5)
    assert exits == [] and watchdog.running
    # ... and not because the watchdog never ran: it kept beating (every 0.1 s at timeout 1 s:
    # about 25 beats in 2.5 s) and it read the finished peer's record (the judge's last reading
    # of rank 1 says "done").
    beats = RankStatus.decode(store.get(own_key)).beat - beats_before
    assert beats >= 5, f"the watchdog published {beats} heartbeats in 2.5 s at a 0.1 s interval"
    last = watchdog._judge.last(1)
    assert last is not None and last.state == DONE, f"the watchdog's last reading of the finished rank: {last}"
    store.set("deepcompile/faults/unit/alarm", "rank 1 failed during forward of step 2: ValueError: boom")
    assert _wait_for(lambda: exits)
    assert "rank 1 failed during forward of step 2: ValueError: boom. Rank 0" in err.getvalue()
    watchdog.stop()


def test_look_now_names_a_killed_peer_without_waiting_for_the_interval():
    """A rank whose collective failed asks for a look at once (``on_uncaught``): the dead peer
    is named in far less than the heartbeat interval (3 s at a 30 s timeout)."""
    from deepcompile.faults.status import machine_id

    store, exits, err = dist.HashStore(), [], io.StringIO()
    watchdog = _watchdog(store, 0, 30.0, exits, err).start()
    watchdog.enter("backward", 3)
    assert watchdog.wait_for_look(watchdog.look_now(), 5.0)  # rank 1 has published nothing yet: all well
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    store.set("deepcompile/faults/unit/1", _status(pid=ended.pid, machine=machine_id()).encode())
    started = time.monotonic()
    assert watchdog.wait_for_look(watchdog.look_now(), 2.0)
    assert time.monotonic() - started < 1.5
    assert f"rank 1 died during backward of step 3: its process (pid {ended.pid}) is gone" in err.getvalue()
    assert _wait_for(lambda: exits, 10.0) and exits[0] == EXIT
    watchdog.stop()


@pytest.mark.parametrize("kind,where", [("dead", "waiting"), ("dead", "busy"), ("alive", "busy")])
def test_a_survivor_sent_sigterm_names_the_dead_rank_first(kind, where):
    """torchrun's agent sends SIGTERM to the survivors milliseconds after it sees a worker die,
    before or while they wait for the watchdog to name it (issue 39 item 7). The watchdog's
    SIGTERM handler gives it one fresh look first: the dead rank is named and the process exits
    with 75; with nobody to name, it says so and dies of SIGTERM as it would without it."""
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "_harness" / "sigterm_survivor.py"), kind, where],
                          env=_env(), capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    if kind == "dead":
        assert proc.returncode == EXIT, out
        assert "deepcompile: rank 1 died during backward of step 3: its process (pid" in out, out
        assert "Rank 0 (in backward of step 3) exits with code 75" in out, out
    else:
        assert proc.returncode == -signal.SIGTERM, out
        assert "rank 0 (in backward of step 3) was sent SIGTERM (its launcher ending the job); its fault watchdog " \
               "found no failed rank" in out, out
    assert "the wait ended without an exit" not in out, out


class _SlowStore:
    """A store whose writes take ``delay_s`` once ``slow`` is set: a watchdog thread is then
    inside a store call when the rank stops."""

    def __init__(self, delay_s):
        self.inner, self.delay_s, self.slow, self.calls_in_flight = dist.HashStore(), delay_s, False, 0

    def set(self, key, value):
        self.calls_in_flight += 1
        try:
            if self.slow:
                time.sleep(self.delay_s)
            self.inner.set(key, value)
        finally:
            self.calls_in_flight -= 1

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_stop_returns_only_once_no_watchdog_thread_is_inside_a_store_call():
    """A watchdog thread still inside a store call when the interpreter finalizes aborts the
    process when the call returns (CPython ends the thread with a forced unwind that C++ turns
    into std::terminate). stop() (and so the atexit hook) must wait such calls out, up to
    store_call_limit, not abandon them after a fixed second as it once did."""
    from deepcompile.faults.watchdog import store_call_limit

    timeout_s = 1.0
    delay_s = 1.8  # longer than the second stop() once gave its threads, shorter than the limit + 1 s
    assert delay_s < store_call_limit(timeout_s) + 1.0
    store = _SlowStore(delay_s)
    watchdog = _watchdog(store, 0, timeout_s, [], io.StringIO()).start()
    store.slow = True
    assert _wait_for(lambda: store.calls_in_flight > 0, 5.0), "the monitor never published"
    watchdog.stop()
    assert store.calls_in_flight == 0, "stop() returned while a store call was still running"
    assert not any(t.is_alive() for t in watchdog._threads)


def test_communication_errors_are_told_from_a_rank_s_own_failure():
    from deepcompile.faults.process_hooks import is_symptom

    gloo = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:547] Connection closed by peer [::1]:5")
    assert is_symptom(gloo)
    assert is_symptom(dist.DistBackendError("NCCL communicator was aborted"))
    try:
        try:
            raise gloo
        except RuntimeError as e:
            raise ValueError("the checkpoint could not be written") from e
    except ValueError as chained:
        assert is_symptom(chained)
    assert not is_symptom(ValueError("a bad batch"))
    assert not is_symptom(torch.cuda.OutOfMemoryError("CUDA out of memory"))


def test_kill_points_do_nothing_unless_named(monkeypatch):
    from deepcompile.faults import injection

    calls = []
    injection.kill_point("save:after_write", 0, before=lambda: calls.append(1))  # no DC_TEST_KILL_AT here
    monkeypatch.setattr(injection, "_TARGET", None)
    injection.arm("save:after_write@1")
    # arm() exports the point for child processes; popped here, not through monkeypatch.delenv,
    # whose teardown would put it back and arm every rank that a later test launches.
    os.environ.pop(injection.ENV)
    injection.kill_point("save:after_write", 0, before=lambda: calls.append(1))  # another rank
    injection.kill_point("save:before_write", 1, before=lambda: calls.append(1))  # another point
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    injection.kill_point("save:after_write", 1, before=lambda: calls.append(1))  # a restarted attempt
    assert calls == []


# ---- the config key, read by the engine ---------------------------------------------------------


def test_fault_tolerance_keys_parse_and_are_checked():
    from deepcompile.config import Config, ConfigError

    c = Config.from_any({"zero_optimization": {"stage": 1}})
    assert c.fault_tolerance.enabled is True and c.fault_tolerance.timeout_s == 300.0
    c = Config.from_any({"zero_optimization": {"stage": 1}, "fault_tolerance": {"timeout_s": 12}})
    assert c.fault_tolerance.timeout_s == 12.0 and c.to_dict()["fault_tolerance"]["timeout_s"] == 12.0
    with pytest.raises(ConfigError) as e:
        Config.from_any({"zero_optimization": {"stage": 1}, "fault_tolerance": {"timeout_s": 0.5, "grace": 1}})
    assert sorted(e.value.keys) == ["fault_tolerance.grace", "fault_tolerance.timeout_s"], str(e.value)


def _engine_reads_the_key(ctx):
    import deepcompile
    from deepcompile.faults.status import DONE, RankStatus

    def engine(section):
        model = torch.nn.Linear(4, 2)
        return deepcompile.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                      {"zero_optimization": {"stage": 2}, "fault_tolerance": section})

    off = engine({"enabled": False})
    assert off.faults is None
    off.destroy()
    on = engine({"timeout_s": 7})
    assert on.faults is not None and on.faults.timeout_s == 7.0 and on.faults.running
    loss = on(torch.randn(3, 4)).sum()
    assert on.faults.phase == "forward" and on.faults.step == 0
    on.backward(loss)
    on.step()
    assert on.faults.phase == "step"
    watchdog = on.faults
    on.destroy()
    assert not watchdog.running
    dist.barrier()
    # destroy() published "done": the other ranks stop watching this one.
    other = RankStatus.decode(watchdog._store.get(watchdog._key(1 - ctx.rank)))
    assert other.state == DONE


@pytest.mark.world_size(2)
def test_the_engine_starts_the_watchdog_from_the_config_and_stops_it_at_destroy():
    run_distributed(_engine_reads_the_key, 2)


# ---- real processes: a rank killed, raising, frozen ----------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra):
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
    env.pop("DC_TEST_KILL_AT", None)
    # The workers run NCCL only where a test asks (the gpu tests below): the others stay gloo on the
    # CPU under a GPU run of the suite too, at world sizes the machine's GPUs need not match.
    env.pop("DC_TEST_DEVICE", None)
    env.update(extra)
    return env


class Ranks:
    """``world`` worker processes of one job; ``wait()`` records when each one ended. Each rank
    leads a process group of its own, which ``kill()`` ends whole: nothing a test started outlives
    it (a rank hung in a CUDA or NCCL wait would otherwise hold its GPU for the rest of the run)."""

    def __init__(self, world, args, limit_s=240.0, **env):
        base = _env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(world), **env)
        self.procs = []
        try:
            for r in range(world):
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", "_harness.fault_worker", *args],
                    env=dict(base, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                    text=True, start_new_session=True))
        except BaseException:
            self.kill()
            raise
        self.limit_s = limit_s
        self.ended, self.out, self.err = {}, {}, {}

    def wait(self, expect_hung=()):
        """Until every rank but those of ``expect_hung`` has ended (then those are killed)."""
        try:
            deadline = time.time() + self.limit_s
            while time.time() < deadline:
                for r, p in enumerate(self.procs):
                    if r not in self.ended and p.poll() is not None:
                        self.ended[r] = time.time()
                if all(r in self.ended for r in range(len(self.procs)) if r not in expect_hung):
                    break
                time.sleep(0.05)
        finally:
            self.kill()
            for r, p in enumerate(self.procs):
                self.out[r], self.err[r] = p.communicate()
        return self

    def kill(self):
        """SIGKILL every rank still running, and whatever it started."""
        for p in self.procs:
            if p.returncode is None:  # not reaped yet: its pid, and so its group's id, are still its own
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def code(self, r):
        return self.procs[r].returncode

    def report(self):
        return "\n".join(f"--- rank {r} exit {p.returncode}\n{self.out[r][-2000:]}\n{self.err[r][-4000:]}"
                         for r, p in enumerate(self.procs))


@pytest.mark.world_size(4)
def test_a_rank_killed_mid_step_makes_the_other_three_exit_naming_it_within_the_timeout():
    timeout = 10.0
    ranks = Ranks(4, ["train", "--steps", "4", "--timeout", str(timeout)], DC_TEST_KILL_AT="backward:2@3").wait()
    assert ranks.code(3) == -signal.SIGKILL, ranks.report()
    for r in range(3):
        assert ranks.code(r) == EXIT, ranks.report()
        assert "rank 3 died during backward of step 2" in ranks.err[r], ranks.report()
        assert f"Rank {r} (in backward of step 2) exits with code {EXIT}" in ranks.err[r], ranks.report()
        assert ranks.ended[r] - ranks.ended[3] < timeout + SLACK_S, ranks.report()


@pytest.mark.world_size(2)
def test_a_rank_that_raises_makes_the_other_exit_with_its_error():
    ranks = Ranks(2, ["train", "--steps", "3", "--timeout", "30", "--fault", "raise@1@1"]).wait()
    assert ranks.code(1) == 1 and "ValueError: injected failure on rank 1" in ranks.err[1], ranks.report()
    assert ranks.code(0) == EXIT, ranks.report()
    assert "rank 1 failed during forward of step 1: ValueError: injected failure on rank 1" in ranks.err[0], \
        ranks.report()
    # Reported from rank 1's own record, not after the 30 s timeout.
    assert ranks.ended[0] - ranks.ended[1] < 30.0, ranks.report()


@pytest.mark.world_size(2)
def test_a_frozen_rank_is_given_up_on_after_the_timeout():
    timeout = 5.0
    ranks = Ranks(2, ["train", "--steps", "3", "--timeout", str(timeout), "--fault", "stop@1@1"])
    ranks.wait(expect_hung=(1,))
    assert ranks.code(0) == EXIT, ranks.report()
    assert "rank 1 stopped answering during forward of step 1" in ranks.err[0], ranks.report()
    frozen_at = float(ranks.out[1].split("FAULT ")[1].split()[0])
    assert ranks.ended[0] - frozen_at < timeout + SLACK_S, ranks.report()


def _blocked_rank(tmp_path, native, timeout_s):
    """A rank (fault_worker ``blocked``) whose main thread waits in native code, and a stand-in
    for its peer, killed once the rank waits. The rank's exit code (None: still waiting a minute
    past the timeout, then killed), its stderr, and the seconds from the kill to its exit."""
    peer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    rank = subprocess.Popen([sys.executable, "-m", "_harness.fault_worker", "blocked", "--dir",
                             str(tmp_path / f"store-{native}"), "--peer-pid", str(peer.pid), "--timeout",
                             str(timeout_s), "--native", native], env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        said = rank.stdout.readline().strip()
        peer.kill()
        killed_at = time.time()
        try:
            err = rank.communicate(timeout=timeout_s + 60.0)[1]
            code = rank.returncode
        except subprocess.TimeoutExpired:
            rank.kill()
            err, code = rank.communicate()[1], None
        assert said == "WAITING", err
        return code, err, time.time() - killed_at
    finally:
        for p in (peer, rank):
            if p.poll() is None:
                p.kill()
            p.wait()


@pytest.mark.world_size(2)  # rank 0 of 2, its peer a stand-in
def test_a_rank_whose_main_thread_waits_in_native_code_still_exits_naming_the_failed_rank(tmp_path):
    """Over NCCL a survivor never raises: its main thread waits in a CUDA or NCCL call for a peer
    that is gone. Those calls release the GIL, so the watchdog's threads run and end the process
    (os._exit works from any thread) naming the peer. A call that keeps the GIL starves them: the
    native deadline (faults/deadman.py), which needs neither the GIL nor Python, ends it then,
    saying why it cannot name a rank."""
    from deepcompile.faults.watchdog import native_deadline

    timeout_s = 2.0
    code, err, took = _blocked_rank(tmp_path, "released", timeout_s)
    assert code == EXIT, err
    assert "rank 1 died during backward of step 2" in err, err
    assert f"Rank 0 (in step of step 2) exits with code {EXIT}" in err, err
    assert took < timeout_s + SLACK_S, err  # found by its pid, well within the timeout
    code, err, took = _blocked_rank(tmp_path, "held", timeout_s)
    assert code == EXIT, f"a main thread holding the GIL kept the rank waiting (exit {code}):\n{err}"
    assert f"rank 0 exits with code {EXIT}: its fault watchdog has not run for {native_deadline(timeout_s):.1f} s" \
        in err, err
    assert "rank 1 died" not in err, err  # the watchdog never ran: it cannot know


# ---- the same over NCCL, one rank per GPU ---------------------------------------------------------
# A survivor does not raise there: it waits in a collective (deepcompile's own NCCL communicator,
# which torch's NCCL watchdog does not watch) and only the fault watchdog, through os._exit, ends
# it. Rank 0 may be queued a phase ahead on the GPU when it leaves, so its own phase is not checked.


@pytest.mark.gpu
@pytest.mark.world_size(2)
def test_over_nccl_a_rank_killed_mid_step_makes_the_other_exit_naming_it_within_the_timeout():
    require_world_size(2)
    timeout = 10.0
    ranks = Ranks(2, ["train", "--steps", "4", "--timeout", str(timeout)], DC_TEST_KILL_AT="backward:2@1",
                  DC_TEST_DEVICE="cuda").wait()
    assert ranks.code(1) == -signal.SIGKILL, ranks.report()
    assert ranks.code(0) == EXIT, ranks.report()
    assert "rank 1 died during backward of step 2" in ranks.err[0], ranks.report()
    assert "Rank 0 (in " in ranks.err[0] and f"exits with code {EXIT}" in ranks.err[0], ranks.report()
    assert ranks.ended[0] - ranks.ended[1] < timeout + SLACK_S, ranks.report()


@pytest.mark.gpu
@pytest.mark.world_size(2)
def test_over_nccl_a_rank_that_raises_makes_the_other_exit_with_its_error():
    require_world_size(2)
    timeout = 30.0
    ranks = Ranks(2, ["train", "--steps", "3", "--timeout", str(timeout), "--fault", "raise@1@1"],
                  DC_TEST_DEVICE="cuda").wait()
    # The rank that raised ends as any uncaught error ends a script (its runtime's NCCL teardown
    # must not wait for the survivor that has left).
    assert ranks.code(1) == 1 and "ValueError: injected failure on rank 1" in ranks.err[1], ranks.report()
    assert ranks.code(0) == EXIT, ranks.report()
    assert "rank 1 failed during forward of step 1: ValueError: injected failure on rank 1" in ranks.err[0], \
        ranks.report()
    # Reported from rank 1's own record, not after the timeout.
    raised_at = float(ranks.out[1].split("FAULT ")[1].split()[0])
    assert ranks.ended[0] - raised_at < timeout, ranks.report()


# ---- a rank killed during save_checkpoint --------------------------------------------------------

# (kill point, rank killed, tag of the second save): every point of the commit protocol.
SAVE_KILLS = [("save:before_write", 1, None), ("save:after_write", 1, None), ("save:before_commit", 0, None),
              ("save:commit_aside", 0, "global_step2"), ("save:before_latest", 0, None),
              ("save:latest_staged", 0, None)]


def _load_and_compare(ctx, cases):
    from _harness.fault_worker import build_engine

    for root, reference in cases:
        want = torch.load(reference)
        for tag in (None, "global_step2"):
            engine = build_engine(30.0)
            path, client = engine.load_checkpoint(root, tag=tag)
            got = engine.full_state_dict(all_ranks=True)
            assert engine.global_steps == want["global_steps"] == 2 and client == {"saved_at": 2}, (root, tag, path)
            assert got.keys() == want["params"].keys()
            for name, value in want["params"].items():
                assert torch.equal(got[name], value), f"{root} ({tag}): {name} differs from what was saved"
            engine.destroy()


@pytest.mark.world_size(2)
def test_a_rank_killed_anywhere_in_save_checkpoint_leaves_the_previous_checkpoint_and_latest(tmp_path):
    runs = []
    for point, killed, tag in SAVE_KILLS:
        root, reference = tmp_path / point.replace(":", "_"), tmp_path / f"{point.replace(':', '_')}.pt"
        args = ["save", "--steps", "2", "--timeout", "20", "--dir", str(root), "--reference", str(reference)]
        if tag:
            args += ["--second-tag", tag]
        runs.append((point, killed, root, reference, Ranks(2, args + ["--kill-at", f"{point}@{killed}"])))
    try:
        for point, killed, root, reference, ranks in runs:  # all at once: most of each run is start-up
            ranks.wait()
            assert ranks.code(killed) == -signal.SIGKILL, f"{point}:\n{ranks.report()}"
            assert ranks.code(1 - killed) == EXIT, f"{point}:\n{ranks.report()}"
            # Rank 0 serves the store here: once it is dead, its phase is the last one rank 1 had read.
            said = f"rank {killed} died during save_checkpoint of step 3" if killed else "rank 0 died during"
            assert said in ranks.err[1 - killed], ranks.report()
            assert (root / "latest").read_text() == "global_step2", point
    finally:
        for *_, ranks in runs:  # a failed check leaves no run behind
            ranks.kill()
    run_distributed(_load_and_compare, 2, args=([(str(root), str(ref)) for _, _, root, ref, _ in runs],))


# ---- torchrun --max-restarts: examples/elastic_restart.py ----------------------------------------


@pytest.mark.world_size(2)  # torchrun --nproc-per-node 2
def test_torchrun_restarts_after_a_killed_rank_and_ends_bitwise_as_an_uninterrupted_run(tmp_path):
    def torchrun(name, restarts, **env):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "--max-restarts", str(restarts), str(ROOT / "examples" / "elastic_restart.py"), "--cpu",
               "--steps", "6", "--save-every", "2", "--timeout", "30", "--out", str(tmp_path / name),
               "--final", str(tmp_path / f"{name}.pt")]
        return subprocess.Popen(cmd, env=_env(**env), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)

    killed = torchrun("killed", 1, DC_TEST_KILL_AT="backward:3@1")
    straight = torchrun("straight", 0)
    outputs = {}
    for name, proc in (("killed", killed), ("straight", straight)):
        outputs[name] = proc.communicate(timeout=400)[0]
        assert proc.returncode == 0, f"{name}:\n{outputs[name][-8000:]}"
    out = outputs["killed"]
    assert "killing this process" in out and "at backward:3" in out, out[-8000:]
    # The survivor names the dead rank before torchrun's agent ends it (issue 39 item 7).
    assert "deepcompile: rank 1 died during backward of step 3" in out, out[-8000:]
    assert "elastic_restart: attempt 1, 2 ranks on cpu, resumed from" in out and "global_step2 at step 2" in out, \
        out[-8000:]
    want, got = torch.load(tmp_path / "straight.pt"), torch.load(tmp_path / "killed.pt")
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), f"{name} differs after the restart"
    digest = [line for line in outputs["straight"].splitlines() if "parameter digest" in line]
    assert digest and digest[0] in out


def test_no_kill_point_is_left_armed_for_later_tests():
    """Runs after the kill-point test (file order): nothing it armed may reach the ranks that
    later tests launch (a leaked DC_TEST_KILL_AT once killed rank 1 of every later checkpoint save
    in the suite)."""
    from deepcompile.faults import injection

    assert injection.ENV not in os.environ
