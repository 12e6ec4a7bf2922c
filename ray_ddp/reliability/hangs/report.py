"""Reading back what hung ranks wrote (``ray_ddp.reliability.hangs.dump``): one line that names the
stuck ranks, where they are and where the stacks are. Printed by Ray Train's controller
when the attempt fails, and by the driver when the run ends on it. No Ray, no torch."""

from __future__ import annotations

from ray_ddp.io.storage import join, read_text
from ray_ddp.reliability.attempts import last_attempt

MARK = "# ray_ddp hang report"


def hang_folder(run_dir: str, attempt: int) -> str:
    return join(run_dir, "hangs", f"attempt-{attempt}")


def report_path(folder: str, rank: int) -> str:
    """Rank ``rank``'s report in an attempt's hang folder."""
    return join(folder, f"rank-{rank}.txt")


def report_text(header: dict[str, str], sections: list[str]) -> str:
    """A report: the mark, the ``key: value`` header :func:`parse_header` reads, a blank
    line, then the stacks."""
    return "\n".join([MARK, *(f"{k}: {v}" for k, v in header.items()), "", *sections]) + "\n"


def parse_header(text: str) -> dict[str, str]:
    """The ``key: value`` lines at the top of a rank's report."""
    header: dict[str, str] = {}
    for line in text.splitlines()[1:]:
        if not line.strip():
            break
        key, _, value = line.partition(": ")
        header[key] = value
    return header


def read_reports(folder: str, world_size: int) -> dict[int, dict[str, str]]:
    """rank -> its report's header, for the ranks that wrote one."""
    reports = {}
    for rank in range(world_size):
        text = read_text(report_path(folder, rank))
        if text and text.startswith(MARK):
            reports[rank] = parse_header(text)
    return reports


def hang_line(
    folder: str, attempt: int, reports: dict[int, dict[str, str]], world_size: int
) -> str:
    """``hang on attempt N: ...``: the ranks stuck outside a collective (the cause), those
    waiting in one (the effect), those that wrote nothing, and the folder."""
    first = max(reports.values(), key=lambda h: float(h["idle_s"]))
    stuck = {r: h for r, h in reports.items() if h["collective"] != "yes"}
    waiting = {r: h for r, h in reports.items() if h["collective"] == "yes"}
    silent = [r for r in range(world_size) if r not in reports]
    parts = [
        f"hang on attempt {attempt}: no progress for {float(first['idle_s']):.0f} s (allowed "
        f"{float(first['allowed_s']):.0f} s)"
    ]
    if stuck:
        parts.append("stuck: " + "; ".join(_rank_at(r, h) for r, h in sorted(stuck.items())))
    if waiting:
        who = ", ".join(map(str, sorted(waiting)))
        plural = "s" * (len(waiting) > 1)
        header = waiting[min(waiting)]
        parts.append(
            f"waiting {'for them ' * bool(stuck)}in a collective: rank{plural} {who} "
            f"({header['phase']}; after {header['last_progress']})"
        )
    if silent:
        parts.append(f"no report from rank{'s' * (len(silent) > 1)} {', '.join(map(str, silent))}")
    return ". ".join(parts) + f". Stacks: {folder}"


def _rank_at(rank: int, header: dict[str, str]) -> str:
    loading = header.get("loading", "nothing")
    extra = f"; its DataLoader: {loading}" if "waiting for data" in header["phase"] else ""
    after = f"; after {header['last_progress']}" if header["last_progress"] != "unknown" else ""
    return f"rank {rank} in {header['where']} ({header['phase']}{extra}{after})"


def hang_signature(reports: dict[int, dict[str, str]]) -> str:
    """What makes two hangs the same one: where the stuck ranks were, after which step."""
    stuck = {r: h for r, h in reports.items() if h["collective"] != "yes"} or reports
    return "hang: " + "; ".join(
        f"rank {r} at {h['where']} after {h['last_progress']}" for r, h in sorted(stuck.items())
    )


def latest_hang(run_dir: str) -> tuple[str, str] | None:
    """(line, signature) of the latest attempt's hang, if it hung."""
    attempt = last_attempt(run_dir)
    if attempt is None:
        return None
    number, world_size = int(attempt["attempt"]), int(attempt["world_size"])
    folder = hang_folder(run_dir, number)
    reports = read_reports(folder, world_size)
    if not reports:
        return None
    return hang_line(folder, number, reports, world_size), hang_signature(reports)
