"""When a scheduled workflow fires: pure functions over datetimes (no clock, no store).

`last_fire` is the high-water mark: every cron time up to it was started or skipped. At
`now`, the fire times in (last_fire, now] are due. Under `catch_up` each is run, oldest
first, one at a time (a run never overlaps the previous one). Under `skip` only the latest
is run, and only if it is at most `grace_seconds` late; the others are dropped.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from croniter import croniter

from fusegen.workflows.spec import Schedule

_MAX_COUNT = 100_000  # counting skipped fires stops here (a minutely cron down for months)


def next_fire(schedule: Schedule, after: datetime) -> datetime:
    """The first fire time strictly after `after` (an aware datetime)."""
    return croniter(schedule.cron, after.astimezone(schedule.tz)).get_next(datetime)


def latest_fire(schedule: Schedule, now: datetime) -> datetime:
    """The last fire time at or before `now`."""
    prev = croniter(schedule.cron, now.astimezone(schedule.tz)).get_prev(datetime)
    exact = next_fire(schedule, prev)
    return exact if exact <= now else prev


def run_date(schedule: Schedule, fire: datetime) -> str:
    """A fire's run_date: its date on the schedule's wall clock."""
    return fire.astimezone(schedule.tz).date().isoformat()


@dataclass(frozen=True, slots=True)
class Decision:
    fire: datetime | None  # start a run for this fire time, or nothing
    num_skipped: int  # due fire times dropped by the `skip` policy
    last_fire: datetime  # the new high-water mark


def decide(schedule: Schedule, last_fire: datetime, now: datetime) -> Decision:
    """What to do at `now` for a workflow with no run in flight."""
    first = next_fire(schedule, last_fire)
    if first > now:
        return Decision(None, 0, last_fire)
    if schedule.missed == "catch_up":
        return Decision(first, 0, first)
    latest = latest_fire(schedule, now)
    on_time = (now - latest) <= timedelta(seconds=schedule.grace_seconds)
    dropped = _count(schedule, last_fire, latest) - (1 if on_time else 0)
    return Decision(latest if on_time else None, dropped, latest)


def _count(schedule: Schedule, after: datetime, until: datetime) -> int:
    """Fire times in (after, until]."""
    it = croniter(schedule.cron, after.astimezone(schedule.tz))
    n = 0
    while n < _MAX_COUNT and it.get_next(datetime) <= until:
        n += 1
    return n
