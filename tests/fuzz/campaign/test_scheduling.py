"""Which task a free worker gets (kvfuzz.fuzz.campaign.workers.scheduling): the targets take the workers in turn, a
target whose turn has begun is never starved by an earlier one, a target's --duration clock starts with its first
chunk of fresh examples, and a target that drew no example is a problem of the campaign.

The scheduler runs here against simulated workers on a fake clock (each task takes a fixed number of seconds, an
example counts when it starts before its task's deadline, as engine.py's runner does): no process, no kernel, no
timing of this machine."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from kvfuzz.fuzz.campaign.config import CampaignConfig
from kvfuzz.fuzz.campaign.records import TargetStats
from kvfuzz.fuzz.campaign.workers.bookkeeping import TargetState
from kvfuzz.fuzz.campaign.workers.scheduling import Scheduler

#: --duration of the simulated campaigns (seconds of the fake clock).
DURATION = 30.0


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def state(name: str, warm: int = 0) -> TargetState:
    return TargetState(SimpleNamespace(name=name), TargetStats(name), warm=list(range(warm)))


def simulate(config: CampaignConfig, targets: list[TargetState], *, ready: list[float], replay_s: dict[str, float],
             example_s: dict[str, float]) -> list[tuple[float, int, str, str, int]]:
    """Run ``targets`` on ``len(ready)`` simulated workers (worker i free from ``ready[i]``): a replay of target T
    takes ``replay_s[T]``; a chunk runs its examples ``example_s[T]`` apart and counts those that start before its
    deadline (the supervisor's: the target's start, else the task's hand-out, plus --duration), counted when the
    chunk ends; a retry takes one example's time. Returns the tasks handed out: (time, worker, kind, target, chunk)."""
    clock = FakeClock()
    sched = Scheduler(config, {}, len(ready), clock=clock)
    by_name = {t.name: t for t in targets}
    free_at = list(ready)
    running: dict[int, tuple[float, object]] = {}  # worker -> (end, task)
    counts: dict[int, int] = {}  # task id -> the examples its chunk will count
    handed = []
    for _ in range(10_000):
        for w, at in enumerate(free_at):
            if at is not None and at <= clock.now and w not in running:
                task = sched.next_task(targets)
                if task is None:
                    continue
                t = by_name[task.target]
                handed.append((clock.now, w, task.kind, task.target, task.chunk))
                if task.kind == "replay":
                    end = clock.now + replay_s[t.name]
                elif task.kind == "retry":
                    end = clock.now + example_s[t.name]
                else:
                    deadline = (t.start if t.start is not None else task.sent) + config.duration
                    step = example_s[t.name]
                    counts[task.id] = sum(1 for i in range(task.n) if clock.now + i * step <= deadline)
                    end = clock.now + max(counts[task.id], 1) * step
                running[w] = (end, task)
        coming = [at for at in free_at if at > clock.now]  # workers still starting
        if not running and not coming:
            return handed
        w, (end, task) = min(running.items(), key=lambda kv: kv[1][0], default=(None, (float("inf"), None)))
        if coming and min(coming) < end:
            clock.now = min(coming)
            continue
        clock.now = end
        del running[w]
        t = by_name[task.target]
        t.in_flight.remove(task)
        if task.kind == "replay":
            t.replayed = True
        else:  # counted as they end (the supervisor counts each as its worker reports it)
            task.counted = 1 if task.kind == "retry" else counts[task.id]
            t.stats.examples += task.counted
    raise AssertionError("the simulated campaign did not end")


def test_a_target_whose_turn_began_is_not_starved_by_an_earlier_one(tmp_path):
    """`make fuzz` on a 2-core CPU: worker 1 came up while worker 0 replayed the first target's database (slow
    under Triton's interpreter), so it got the second target's replay; the first target then took both workers
    back, chunk after chunk, for its 30 s, and the second target's clock, started at its replay, ran out with
    0 examples (vllm.context_attention_fwd behind vllm.chunked_prefill_paged_decode). Every target gets about its
    --duration of both workers now."""
    config = CampaignConfig(out=tmp_path, max_examples=2**62, duration=DURATION, chunk_examples=4)
    first, second, third = state("first"), state("second"), state("third")
    handed = simulate(config, [first, second, third], ready=[0.0, 1.0], replay_s={"first": 3.0, "second": 4.0,
                      "third": 0.5}, example_s={"first": 2.0, "second": 1.0, "third": 1.0})
    examples = {t.name: t.stats.examples for t in (first, second, third)}
    # two workers for 30 s: 30 examples of 2 s, 60 of 1 s; a turn shares its first and last seconds
    assert examples["first"] >= 20 and examples["second"] >= 40 and examples["third"] >= 40, (examples, handed)
    # each clock started with the target's first chunk of fresh examples, not with its replay
    for t in (first, second, third):
        first_chunk = min(at for at, _, kind, name, chunk in handed if name == t.name and kind == "chunk")
        assert t.start == first_chunk, (t.name, t.start, first_chunk)


def test_the_turns_keep_the_replay_first_and_the_warmup_beside_it(tmp_path):
    """A target's chunks of fresh examples wait for its database replay; its warm-up chunks (compiles) run beside
    the replay, before its turn and its clock."""
    config = CampaignConfig(out=tmp_path, max_examples=12, duration=DURATION, chunk_examples=4, warmup=2)
    a, b = state("a", warm=2), state("b", warm=2)
    handed = simulate(config, [a, b], ready=[0.0, 0.0, 0.0], replay_s={"a": 5.0, "b": 5.0},
                      example_s={"a": 1.0, "b": 1.0})
    for t in (a, b):
        mine = [(at, kind, chunk) for at, _, kind, name, chunk in handed if name == t.name]
        replayed_at = mine[0][0] + 5.0
        assert mine[0][1] == "replay" and [c for _, k, c in mine if k == "chunk" and c < 0] == [-1, -2], mine
        assert all(at >= replayed_at for at, kind, chunk in mine if kind == "chunk" and chunk >= 0), mine
        assert t.start is not None and t.start >= replayed_at
        assert t.stats.examples == 12
    # a's warm-ups came beside its replay, before b's replay; a's turn before b's (the campaign's order)
    assert [(kind, name) for _, _, kind, name, _ in handed[:4]] == [("replay", "a"), ("chunk", "a"), ("chunk", "a"),
                                                                    ("replay", "b")], handed
    assert a.start < b.start


def test_the_latest_turn_comes_first_and_retries_before_its_chunks(tmp_path):
    """Two targets whose turns have begun, the earlier one with budget again (a worker died in its chunk, 2 of
    4 examples counted): the later one gets the workers, its retry before its chunk; the earlier one gets what the
    later cannot use."""
    clock = FakeClock()
    config = CampaignConfig(out=tmp_path, max_examples=8, duration=DURATION, chunk_examples=4)
    sched = Scheduler(config, {}, 2, clock=clock)
    early, late = state("early"), state("late")
    for t in (early, late):
        t.replayed = t.replay_issued = True
    assert [(x.target, x.n) for x in (sched.next_task([early, late]), sched.next_task([early, late]))] == [
        ("early", 4), ("early", 4)]  # early's turn: its 8 examples handed out
    clock.now = 1.0
    assert (sched.next_task([early, late]).target, early.start, late.start) == ("late", 0.0, 1.0)
    early.in_flight.pop(0)
    early.stats.examples, late.retries = 2, [{"example": 1}]  # 2 of early's examples to draw again
    tasks = [sched.next_task([early, late]) for _ in range(4)]
    assert [(x.target, x.kind, x.n) for x in tasks[:3]] == [("late", "retry", 0), ("late", "chunk", 4),
                                                              ("early", "chunk", 2)]
    assert tasks[3] is None  # both budgets handed out


@pytest.mark.parametrize("duration", [DURATION, None])
def test_a_target_that_drew_no_example_is_a_problem(tmp_path, duration):
    """A target the campaign ran but that drew no example (its budget consumed before a worker reached it) is a
    problem of the campaign (summary.json `problems`, exit 3), naming the target and the budget; a target that
    drew one, was stopped early (its reason is in the summary), or ended on its first failure where the campaign
    stops there, is not."""
    config = CampaignConfig(out=tmp_path, max_examples=5, duration=duration)
    sched = Scheduler(config, {}, 2)
    never, begun, ran, stopped, lost = (state(n) for n in ("never", "begun", "ran", "stopped", "lost"))
    begun.start = 0.0
    ran.stats.examples = 1
    stopped.stats.stopped = "stopped after 10 crashes and hangs (--max-crashes 10)"
    lost.stats.lost = 1  # its own problem: examples lost
    problems = sched.unserved([never, begun, ran, stopped, lost])
    budget = f"--duration {duration:g} s" if duration else "--max-examples 5"
    assert [p.split(" ")[0] for p in problems] == ["never", "begun"]
    assert all(f"drew no example ({budget} asked for some)" in p for p in problems), problems
    assert "never got a worker" in problems[0] and "its turn began" in problems[1]
    found = state("found")
    found.stats.failures[("kernel mismatch", "allclose")] = object()  # found in its replay
    assert sched.unserved([found]) and not Scheduler(
        CampaignConfig(out=tmp_path, stop_at_first_failure=True), {}, 1).unserved([found])


def test_a_campaign_whose_target_drew_no_example_says_so_and_exits_3(tmp_path, monkeypatch, capfd):
    """Planted: the second target's budget is spent before any worker reaches it (its chunks never come). The
    campaign runs both targets in real workers; its summary.json, its end lines and report.md name the target as a
    problem, and the exit status is 3 (nothing failed, but the campaign did not run as asked)."""
    from support import SUPPORT

    from kvfuzz.fuzz.campaign.workers.supervisor import Supervisor
    from kvfuzz.fuzz.cli.fuzz import EXIT_CANNOT_RUN, _finish
    from kvfuzz.fuzz.targets import get_target

    specs = [f"{SUPPORT / 'planted_endings.py'}:Correct", f"{SUPPORT / 'planted_endings.py'}:Slow"]
    monkeypatch.setattr(Scheduler, "_chunk", lambda self, t, now, real=Scheduler._chunk:
                        None if t.name == "planted.slow" else real(self, t, now))
    targets = [get_target(s) for s in specs]
    config = CampaignConfig(out=tmp_path / "out", max_examples=3, structural_shrink=0)
    result = Supervisor(targets, specs, config, resume=False).run()
    assert [s.examples for s in result.targets] == [3, 0]
    assert result.problems == ["planted.slow drew no example (--max-examples 3 asked for some): it never got a "
                               f"worker for a chunk of fresh examples; it was not fuzzed (what the workers ran is in "
                               f"{config.out}/workers)"]
    capfd.readouterr()
    code = _finish(result, targets, config, config.out)
    said = capfd.readouterr().out  # the end lines (never wrapped off a terminal)
    summary = json.loads((config.out / "summary.json").read_text())
    assert code == EXIT_CANNOT_RUN and summary["exit_status"] == 3 and summary["problems"] == result.problems
    assert f"problem: {result.problems[0]}" in said, said
    assert f"**Problem**: {result.problems[0]}" in (config.out / "report.md").read_text()
