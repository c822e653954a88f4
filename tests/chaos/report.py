"""Render the chaos suite's results (``AGENTFAST_CHAOS_RESULTS``) into docs/reliability.md.

    python -m tests.chaos.report --results DIR --doc docs/reliability.md --command "hack/chaos.sh" --seed 42 --rc 0

Replaces the text between ``<!-- chaos-results:begin -->`` and ``<!-- chaos-results:end -->``;
the rest of the page is prose kept by hand. hack/chaos.sh calls this after its run.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
from pathlib import Path

BEGIN = "<!-- chaos-results:begin -->"
END = "<!-- chaos-results:end -->"

COLUMNS = [
    ("runs", "runs"),
    ("processes", "processes"),
    ("kills", "kills"),
    ("kills_fault", "at a fault point"),
    ("kills_external", "at a random time"),
    ("resumes", "resumes"),
    ("retry_exits", "exits 75"),
    ("start_failures", "exits 3 (Postgres unreachable at start)"),
    ("approvals", "approvals"),
    ("reruns_approved", "in-flight re-runs approved"),
    ("reruns_denied", "in-flight re-runs denied"),
    ("same_key_reruns", "same-key re-executions (G4)"),
    ("duplicated_effects", "**duplicated effects**"),
    ("lost_results", "**lost results**"),
    ("unexpected_effects", "**unexpected effects**"),
    ("diverged_transcripts", "**diverged transcripts**"),
    ("unexpected_exits", "**unexpected exits**"),
]


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def render(results: Path, command: str, seed: str, rc: int, elapsed_s: float | None) -> str:
    def load(name: str) -> dict | None:
        p = results / f"{name}.json"
        return json.loads(p.read_text()) if p.exists() else None

    kr, zombie, pg, disk = load("kill_resume"), load("zombie"), load("postgres_restarts"), load("out_of_disk")
    out = [BEGIN, ""]
    when = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    dirty = " (with uncommitted changes)" if _git("status", "--porcelain", "--untracked-files=no") else ""
    out.append(
        f"Last large run: {when}, commit `{_git('rev-parse', '--short', 'HEAD')}`{dirty}, "
        f"{os.cpu_count()} CPUs, seed **{seed}**, pytest exit code {rc}"
        + (f", {elapsed_s / 60:.0f} minutes" if elapsed_s else "")
        + "."
    )
    out.append("")
    out.append(f"    {command}")
    out.append("")
    if kr:
        out.append(f"**Kill and resume** ({kr.get('workers', '?')} runs at a time, {kr.get('elapsed_s', 0) / 60:.0f} minutes):")
        out.append("")
        scenarios = sorted(kr["scenarios"])
        out.append("| | " + " | ".join(scenarios) + " | **total** |")
        out.append("|---|" + "---:|" * (len(scenarios) + 1))
        for key, label in COLUMNS:
            vals = [kr["scenarios"][s].get(key, 0) for s in scenarios]
            out.append(f"| {label} | " + " | ".join(str(v) for v in vals) + f" | **{sum(vals)}** |")
        out.append("")
        points = ", ".join(f"{p} {n}" for p, n in sorted(kr["points"].items(), key=lambda x: -x[1]))
        out.append(f"Kills by where they landed: {points}.")
        out.append("")
        if kr["problems"]:
            out.append("Problems found:")
            out.append("")
            out += [f"- {p[:400]}" for p in kr["problems"][:30]]
            out.append("")
    if zombie:
        out.append(
            f"**Zombies** (frozen with SIGSTOP at a random moment, a successor finishes the run, then SIGCONT): "
            f"{zombie['rounds']} rounds ({zombie.get('finished_before_freeze', 0)} more finished before the freeze); {zombie['zombies_fenced']} zombies exited 76, "
            f"{zombie['zombie_finished_first']} had already finished; rows written by a thawed zombie: "
            f"**{zombie['zombie_rows_after_thaw']}**; tool calls started by a thawed zombie: "
            f"**{zombie['zombie_tool_starts_after_thaw']}**; takeovers blocked: **{zombie['takeover_blocked']}**; "
            f"duplicated effects **{zombie['duplicated_effects']}**, lost results **{zombie['lost_results']}**, "
            f"diverged transcripts **{zombie['diverged']}**."
        )
        out.append("")
    if pg:
        out.append(
            f"**Postgres restarts** mid-run: {pg['rounds']} runs, {pg['outages']} outages "
            f"({pg['restart-fast']} fast restarts, {pg['restart-immediate']} immediate (crash-recovery) restarts, "
            f"{pg['stop-start']} stop-pause-start, {pg['long-outage']} outage longer than the 30 s retry window); "
            f"{pg['processes']} runner processes, {pg['exits_75']} exits 75, {pg['exits_3']} exits 3; every run ended "
            f"equal to its reference (the numbers are written only when the test passed)."
        )
        out.append("")
    if disk:
        out.append(
            f"**Out of disk** (the runtime's tables on a full 16 MiB tmpfs tablespace): {disk['rounds']} runs, "
            f"{disk['runtime_writes_refused']} of the runtime's writes refused with ENOSPC, {disk['exits_75']} exits 75; "
            f"every run ended equal to its reference, with no tool executed beyond its journaled intents."
        )
        out.append("")
    ro = {a: load(f"read_only_{a}") for a in ("vanilla", "langgraph")}
    if any(ro.values()):
        parts = [
            f"{a}: {'kept retrying' if r['exit_while_read_only'] is None else 'exited ' + str(r['exit_while_read_only'])} "
            f"while read-only, the refund ran {r['refund_runs_while_read_only']} times then, {r['refund_runs']} in all"
            for a, r in ro.items()
            if r
        ]
        out.append("**Read-only failover** (passed): " + "; ".join(parts) + "; end state equal to the reference.")
        out.append("")
    priv = [(n, load(n)) for n in ("privilege_UPDATE_agentfast_tool_calls", "privilege_INSERT_agentfast_messages")]
    if any(r for _, r in priv):
        parts = [
            f"{n.split('_', 2)[1]} on {n.split('_', 2)[2]} revoked: exit {r['exit_while_revoked']}, the refund ran "
            f"{r['refund_runs_while_revoked']} times meanwhile, {r['refund_runs']} in all"
            for n, r in priv
            if r
        ]
        out.append("**Revoked grants** (passed): " + "; ".join(parts) + "; end state equal to the reference.")
        out.append("")
    out.append(END)
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--results", required=True, type=Path)
    ap.add_argument("--doc", required=True, type=Path)
    ap.add_argument("--command", required=True)
    ap.add_argument("--seed", required=True)
    ap.add_argument("--rc", type=int, default=0)
    ap.add_argument("--elapsed-s", type=float, default=None)
    a = ap.parse_args()
    block = render(a.results, a.command, a.seed, a.rc, a.elapsed_s)
    text = a.doc.read_text() if a.doc.exists() else f"# Reliability\n\n{BEGIN}\n{END}\n"
    if BEGIN not in text or END not in text:
        text = text.rstrip() + f"\n\n## Results\n\n{BEGIN}\n{END}\n"
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    a.doc.write_text(head + block + tail)
    print(block)


if __name__ == "__main__":
    main()
