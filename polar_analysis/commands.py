"""`polar calls | inspect | align | drift | trajectories | flows`: captures -> frames -> trajectories.

SOURCE arguments accept a capture directory (``sessions/*.jsonl``), a saved mitmproxy flow file,
or a calls Parquet written by ``polar calls``.
"""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import polars as pl
import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from polar_core.console import make_console

console = make_console()

SourceArg = Annotated[Path, typer.Argument(resolve_path=True, help="Capture directory, mitmproxy flow file, or calls Parquet.", show_default=False)]
ModelOpt = Annotated[Optional[str], typer.Option(
    "--model",
    help="Model directory or built model name whose tokenizer/chat template to use "
    "(default: the capture's served model, looked up under POLAR_HOME/models).",
)]


class Mode(str, Enum):
    per_request = "per-request"
    prefix_merge = "prefix-merge"


def _progress() -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    )


def _load(source: Path, rewards: Optional[Path] = None, translate=None):
    """(calls LazyFrame, ScanReport or None) with a progress bar over JSONL conversion."""
    from polar_analysis import frames

    if not source.exists():
        console.print(f"[red]{source} does not exist[/red]")
        raise typer.Exit(2)
    if source.is_dir():
        report = frames.ScanReport()
        with _progress() as prog:
            task = prog.add_task("converting captures", total=None)

            def tick(done: int, total: int) -> None:
                prog.update(task, completed=done, total=total)

            lf = frames.calls(source, report=report, progress=tick, rewards=rewards if rewards else "auto")
        return lf, report
    lf = frames.load(source, translate=translate)
    if rewards:
        lf = frames.attach_session_rewards(lf.drop("reward", "rollout_status", strict=False), None, rewards)
    return lf, None


def _scan_line(report) -> str:
    if report is None:
        return ""
    t = report.totals()
    return (
        f"{len(report.files)} session files ({report.converted} converted, {report.appended} appended, "
        f"{report.cached} cached); {t['records']} records, {t['invalid']} invalid lines skipped, "
        f"{t['recovered']} recovered, {t['torn_tail']} torn tails"
    )


def _renderer(lf: pl.LazyFrame, model: Optional[str], required: bool):
    from polar_analysis import alignment

    try:
        r = alignment.renderer_for_calls(lf, model)
    except (FileNotFoundError, OSError) as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2)
    if r is None and required:
        console.print("[red]no tokenizer found for this capture's model: pass --model DIR[/red]")
        raise typer.Exit(2)
    return r


def _cell(v, float_fmt: str, width: int) -> str:
    if v is None:
        return ""
    text = float_fmt.format(v) if isinstance(v, float) else str(v)
    return text if len(text) <= width else text[: width - 1] + "…"


def _table(df: pl.DataFrame, title: str, float_fmt: str = "{:.3f}", width: int = 48) -> Table:
    t = Table(title=title, title_justify="left")
    for c in df.columns:
        t.add_column(c, justify="right" if df[c].dtype.is_numeric() else "left", overflow="fold")
    for row in df.iter_rows():
        t.add_row(*[_cell(v, float_fmt, width) for v in row])
    return t


def _stats_table(stats) -> Table:
    d = stats.as_dict()
    t = Table(title=f"trajectories ({stats.mode})", title_justify="left", show_header=False)
    t.add_column("k")
    t.add_column("v", justify="right")
    for k in ("calls", "usable_calls", "skipped_error", "skipped_empty", "skipped_error_sampled_tokens",
              "skipped_no_logprobs", "skipped_no_logprobs_sampled_tokens", "auxiliary_calls",
              "auxiliary_sampled_tokens", "sessions",
              "chains", "sequences", "merges", "breaks", "sampled_tokens", "covered_tokens", "sequence_tokens"):
        t.add_row(k, str(d[k]))
    t.add_row("coverage", f"{stats.coverage:.4%}")
    t.add_row("merge rate", f"{stats.merge_rate:.2%}")
    t.add_row("exact-merge rate", f"{stats.exact_merge_rate:.2%}")
    t.add_row("calls per sequence", f"{stats.calls_per_sequence:.2f}")
    t.add_row("merge kinds", json.dumps(d["merge_kinds"]))
    t.add_row("break causes", json.dumps(d["break_reasons"]))
    t.add_row("auxiliary (left out)", json.dumps(d["auxiliary"]))
    t.add_row("template", d["template"])
    return t


def _print_history(lf: pl.LazyFrame) -> None:
    """Exact-history captures (polar_exact_history): how each prompt's history was made, and why
    not exact (harness edits such as history_edited / answer_changed; the template re-rendering an
    answer is what the mode removes)."""
    if "history" not in lf.collect_schema().names():
        return
    h = (lf.filter(pl.col("history").is_not_null())
         .with_columns(kind=pl.col("history").str.replace(r"^spliced_at=\d+$", "spliced"))
         .group_by("kind", "history_cause").agg(calls=pl.len()).sort("calls", descending=True).collect())
    if h.height:
        console.print(_table(h, "exact-history mode: prompt history per call"))


def register(app: typer.Typer, *, translate=None) -> None:
    """Add the analysis commands to ``app``. ``translate``: the proxy's request translators
    (``polar_proxy.providers.chat_request_of``), which rebuild normalized requests of saved flows;
    the ``polar`` CLI passes them in (this package does not import the proxy)."""

    @app.command("calls")
    def calls_cmd(
        source: SourceArg,
        out: Annotated[Path, typer.Option("--out", "-o", resolve_path=True, help="Parquet file to write (one row per model call).")],
    ) -> None:
        """Write the calls frame of a capture (token ids as list columns, nested JSON as strings)."""
        lf, report = _load(source, translate=translate)
        out.parent.mkdir(parents=True, exist_ok=True)
        # full prompt ids, not references into the capture's cache: the file stands on its own
        lf.drop("prompt_arena", "prompt_ids_start", "native_request_rope", "normalized_request_rope",
                strict=False).sink_parquet(out)
        n = pl.scan_parquet(out).select(pl.len()).collect().item()
        console.print(f"wrote {n} calls to {out}")
        if report:
            console.print(_scan_line(report))

    captures = typer.Typer(help="Capture files themselves: `polar captures convert`.", no_args_is_help=True)
    app.add_typer(captures, name="captures")

    @captures.command("convert")
    def convert_cmd(
        source: Annotated[Path, typer.Argument(help="Capture directory (sessions/*.jsonl) to read.", show_default=False)],
        dest: Annotated[Path, typer.Argument(help="Capture directory to write (must not be SOURCE).", show_default=False)],
        full: Annotated[bool, typer.Option("--full", help="Every record in full (the layout before schema 3).")] = False,
    ) -> None:
        """Rewrite a capture's session files as deltas (schema 3), or back in full with --full."""
        from polar_core.capture_delta import convert_file
        from polar_core.schema import SESSIONS_SUBDIR

        from polar_analysis.frames import session_files

        files = session_files(source) if source.is_dir() else []
        if not files:
            console.print(f"[red]no session files under {source}[/red]")
            raise typer.Exit(2)
        if dest.resolve() == source.resolve():
            console.print("[red]DEST must be another directory than SOURCE[/red]")
            raise typer.Exit(2)
        out = dest / SESSIONS_SUBDIR
        out.mkdir(parents=True, exist_ok=True)
        records = bytes_in = bytes_out = 0
        for f in files:
            n, i, o = convert_file(f, out / f.name, delta=not full)
            records, bytes_in, bytes_out = records + n, bytes_in + i, bytes_out + o
        console.print(f"{records} records of {len(files)} sessions: {bytes_in / 1e6:.2f} MB -> {bytes_out / 1e6:.2f} MB "
                      f"in {out}")

    @app.command("inspect")
    def inspect_cmd(
        source: SourceArg,
        model: ModelOpt = None,
        rewards: Annotated[Optional[Path], typer.Option(resolve_path=True, help="Rewards file (see `polar trajectories --help`).")] = None,
    ) -> None:
        """A readable summary: sessions, calls per harness/provider, tokens, errors, merging, rewards."""
        from polar_analysis import alignment, frames
        from polar_analysis.trajectories import prefix_merge

        lf, report = _load(source, rewards, translate)
        if report:
            console.print(_scan_line(report))
        sess = frames.sessions(lf).collect()
        by_hp = (
            lf.group_by("harness", "provider")
            .agg(
                calls=pl.len(),
                sessions=pl.col("session_id").n_unique(),
                errors=(pl.col("status") != "ok").sum(),
                prompt_ids=pl.col("n_prompt_ids").sum(),
                sampled_ids=pl.col("n_sampled_ids").sum(),
                p50_latency_s=pl.col("latency_s").median(),
            )
            .sort("calls", descending=True)
            .collect()
        )
        console.print(f"[bold]{sess.height}[/bold] sessions, [bold]{int(by_hp['calls'].sum())}[/bold] calls")
        console.print(_table(by_hp, "calls per harness / provider"))
        fin = lf.group_by("finish_reason").len().sort("len", descending=True).collect()
        console.print(_table(fin, "finish reasons"))
        errors = lf.filter(pl.col("status") != "ok").group_by("error_kind").agg(calls=pl.len(), example=pl.col("error").first()).collect()
        if errors.height:
            console.print(_table(errors, "errors"))
        renderer = _renderer(lf, model, required=False)
        template = alignment.template_info_for(renderer, lf)
        _, stats = prefix_merge.build(lf, template=template)
        console.print(_stats_table(stats))
        rw = sess.filter(pl.col("rollout_status").is_not_null()) if "rollout_status" in sess.columns else sess.clear()
        if rw.height:
            dist = rw.group_by("rollout_status").agg(
                sessions=pl.len(),
                with_reward=pl.col("reward").is_not_null().sum(),
                mean=pl.col("reward").mean(),
                std=pl.col("reward").std(),
                min=pl.col("reward").min(),
                max=pl.col("reward").max(),
                positive=(pl.col("reward") > 0).sum(),
            )
            console.print(_table(dist.sort("rollout_status"), "rewards (per session, by run status)"))
            hist = rw.filter(pl.col("reward").is_not_null()).group_by(pl.col("reward").round(2)).len().sort("reward")
            if hist.height:
                console.print(_table(hist, "reward distribution"))
        else:
            console.print("rewards: none attached (no rollouts.parquet, no --rewards)")

    @app.command("align")
    def align_cmd(
        source: SourceArg,
        model: ModelOpt = None,
        out: Annotated[Optional[Path], typer.Option("--out", "-o", resolve_path=True, help="Parquet of the per-call alignment.")] = None,
        show: Annotated[int, typer.Option(help="Divergent calls to print.")] = 10,
    ) -> None:
        """Re-render every normalized request with the chat template and compare with the server's ids."""
        from polar_analysis import alignment

        lf, _ = _load(source, translate=translate)
        renderer = _renderer(lf, model, required=True)
        total = lf.select(pl.len()).collect().item()
        with _progress() as prog:
            task = prog.add_task(f"re-rendering ({renderer.name})", total=total)
            df = alignment.align(lf, renderer, progress=lambda n: prog.advance(task, n))
        console.print(_table(df.group_by("status").len().sort("len", descending=True), "alignment"))
        bad = df.filter(pl.col("status") == "diverged").head(show)
        if bad.height:
            console.print(_table(bad.select("session_id", "call_index", "first_divergence", "server_text", "rendered_text"), "first divergences"))
        if out:
            df.write_parquet(out)
            console.print(f"wrote {df.height} rows to {out}")

    @app.command("drift")
    def drift_cmd(
        source: SourceArg,
        model: ModelOpt = None,
        out: Annotated[Optional[Path], typer.Option("--out", "-o", resolve_path=True, help="Parquet of the per-call drift report.")] = None,
        show: Annotated[int, typer.Option(help="Non-exact continuations to print.")] = 15,
    ) -> None:
        """Why each call's prompt is not the previous prompt + sampled ids, classified by cause."""
        from polar_analysis import alignment, drift

        lf, _ = _load(source, translate=translate)
        renderer = _renderer(lf, model, required=False)
        report = drift.drift_report(lf, alignment.template_info_for(renderer, lf))
        console.print(_table(drift.summarize(report).filter(pl.col("calls") > 0), "drift causes"))
        console.print(_table(drift.by_origin(report), "who changed the history (rerendered: the template; harness: the harness's own edit)"))
        rows = report.filter(~pl.col("exact") & (pl.col("cause") != "new_conversation")).head(show)
        if rows.height:
            console.print(
                _table(rows.select("session_id", "call_index", "prev_call_index", "cause", "origin", "prompt_divergence", "answer_divergence", "detail"), "examples")
            )
        if out:
            report.write_parquet(out)
            console.print(f"wrote {report.height} rows to {out}")

    @app.command("trajectories")
    def trajectories_cmd(
        source: SourceArg,
        mode: Annotated[Mode, typer.Option("--mode", help="per-request: one sequence per call; prefix-merge: the turns of a conversation in one sequence.")] = Mode.prefix_merge,
        out: Annotated[Path, typer.Option("--out", "-o", resolve_path=True, help="Trajectory Parquet (schema.TRAJECTORY_COLUMNS).")] = ...,
        rewards: Annotated[Optional[Path], typer.Option(
            "--rewards",
            resolve_path=True,
            help="Rewards per session: Parquet, JSONL or CSV with session_id and reward (optional status: "
            "ok | timeout | failed; optional task_id, group_id). Default: <capture>/rollouts.parquet "
            "written by `polar rollout`, when present.",
        )] = None,
        strict: Annotated[bool, typer.Option("--strict", help="Split wherever a merge is not exact (next prompt did not repeat the sampled ids).")] = False,
        model: ModelOpt = None,
    ) -> None:
        """Rebuild training sequences from captured token ids (loss mask 1 exactly on sampled ids).

        Rewards are attached per session from --rewards or <capture>/rollouts.parquet; sessions without one get a null reward. Coverage (sampled ids present with loss mask 1) is checked against the calls and again against the raw capture lines, per session; below 100% the command exits 1.
        """
        from polar_analysis import alignment, rewards as rw
        from polar_analysis import trajectories

        lf, report = _load(source, translate=translate)
        if report:
            console.print(_scan_line(report))
        template = None
        renderer = _renderer(lf, model, required=False)
        if mode == Mode.prefix_merge:
            template = alignment.template_info_for(renderer, lf)
        fingerprint = alignment.tokenizer_fingerprint(renderer)
        if fingerprint is None:
            console.print("[yellow]no tokenizer found for this capture's model (pass --model DIR): the trajectories "
                          "carry no tokenizer fingerprint, and `polar train` cannot check it[/yellow]")
        table = rw.resolve(source if source.is_dir() else None, rewards)
        df, stats = trajectories.build(lf, mode.value, strict=strict, template=template, rewards=table,
                                       tokenizer_fingerprint=fingerprint)
        out.parent.mkdir(parents=True, exist_ok=True)
        df.write_parquet(out)
        console.print(_stats_table(stats))
        _print_history(lf)
        with_reward = df["reward"].is_not_null().sum()
        console.print(f"wrote {df.height} sequences to {out} ({with_reward} with a reward)")
        if stats.auxiliary:  # harness side calls (titles, next-speaker checks): not the agent's turns
            console.print(stats.auxiliary_summary)
        if stats.coverage < 1.0:
            console.print(f"[red]coverage {stats.coverage:.4%}: some sampled ids are not in any sequence[/red]")
            raise typer.Exit(1)
        if source.is_dir():  # counted again from the raw capture lines, independently of the loader
            from polar_analysis.trajectories.common import capture_coverage

            cov = capture_coverage(source, df)
            low = cov.filter(pl.col("coverage") < 1.0)
            total = cov["covered"].sum() / max(cov["sampled"].sum(), 1)
            console.print(f"coverage from the raw capture lines: {total:.4%} of {cov['sampled'].sum()} sampled ids")
            if low.height:
                console.print(_table(low, "sessions with sampled ids missing from the trajectories"))
                raise typer.Exit(1)
        issues = df["sampling_issue"].drop_nulls()
        if issues.len():
            console.print(f"[yellow]{issues.len()} sequences the trainer will refuse (it cannot reproduce their "
                          f"sampling distribution), e.g. {issues[0]}[/yellow]")

    @app.command("flows")
    def flows_cmd(
        files: Annotated[list[Path], typer.Argument(resolve_path=True, help="Saved mitmproxy flow files (mitmdump -w).", show_default=False)],
        out: Annotated[Optional[Path], typer.Option("--out", "-o", resolve_path=True, help="Calls Parquet to write.")] = None,
        capture: Annotated[Optional[Path], typer.Option("--capture", resolve_path=True, help="Capture directory to take token ids from (joined by call_id).")] = None,
    ) -> None:
        """Rebuild calls from saved mitmproxy flows (bodies + flow.metadata['polar'])."""
        from polar_analysis import frames

        parts, all_stats = [], []
        for f in files:
            if not f.is_file():
                console.print(f"[red]{f} does not exist[/red]")
                raise typer.Exit(2)
            st = frames.FileStats(path=str(f))
            parts.append(frames.flows_calls(f, stats=st, translate=translate))
            all_stats.append(st)
        df = pl.concat(parts) if parts else frames.empty_calls()
        if capture is not None:
            df = frames.fill_from_capture(df, frames.calls(capture, rewards=None))
        summary = df.group_by("session_id", "harness", "provider").agg(
            calls=pl.len(), errors=(pl.col("status") != "ok").sum(), sampled_ids=pl.col("sampled_token_ids").list.len().sum()
        )
        console.print(_table(summary.sort("session_id"), "flows"))
        for st in all_stats:
            console.print(f"{st.path}: {st.records} calls, {st.other_records} flows without Polar metadata, {st.invalid} invalid")
        if out:
            df.write_parquet(out)
            console.print(f"wrote {df.height} calls to {out}")
