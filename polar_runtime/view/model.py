"""A run directory as the viewer's pages need it: :class:`RunView` loads what it reads once, and
again only what changed (``--serve`` on a running loop calls :meth:`RunView.refresh` on every
request of the run page; a session file is re-read only when its size or time changed).

Samples are numbered in the order of the rollouts table, then any session that has captures but
no rollout row yet (a sample in flight); the page's chunk of sample ``i`` is ``data/samples/<i>.js``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

from polar_core.schema import valid_session_id

from .flows import FlowIndex
from .runfiles import RunFiles
from .sample import build_sample, session_drift
from .summary import build_summary

TRAJ_COLUMNS = ["trajectory_id", "session_id", "segment_index", "chain_index", "input_ids", "loss_mask", "logprobs",
                "reward", "status", "n_calls", "call_ids", "span_call_index", "span_start", "span_end", "span_kind",
                "merge_kind", "policy_version", "temperature", "sampling_issue"]


def tokenizer_decoder(model_dir: str | os.PathLike | None) -> Callable[[list[int]], dict[str, str]] | None:
    """ids -> {id: text}, each id decoded alone (special tokens kept), from a model directory's
    ``tokenizer.json`` (the ``tokenizers`` library alone: a second or so, where transformers'
    AutoTokenizer took 37 s on the loaded 2-core machine); None when there is none (the page
    then shows ids)."""
    if not model_dir or not (Path(model_dir) / "tokenizer.json").is_file():
        return None
    try:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    except Exception:  # noqa: BLE001 - no usable tokenizer: ids are shown
        return None
    cache: dict[int, str] = {}

    def decode(ids: list[int]) -> dict[str, str]:
        out = {}
        for i in ids:
            if i not in cache:
                cache[i] = tok.decode([i], skip_special_tokens=False)
            out[str(i)] = cache[i]
        return out

    return decode


class RunView:
    """Everything the report shows of one run directory."""

    def __init__(self, root: str | os.PathLike, tokenizer: str | os.PathLike | None = None) -> None:
        self.files = RunFiles(root)
        self.flows = FlowIndex(self.files)
        self.tokenizer_dir = tokenizer
        self._decode: Any = None
        self._drift: dict[str, tuple[Any, list[dict[str, Any]]]] = {}  # sid -> (signature, rows)
        self._sig: Any = None
        self.summary: dict[str, Any] = {}
        self.sample_ids: list[str] = []
        self._rollouts: Any = None
        self._record: Any = None
        self._left_out: dict[str, str] = {}
        self._traj_sig: Any = None
        self._trained_steps: set[int] = set()
        self._traj_by_session: dict[str, list[Any]] = {}

    # -- what the run holds ---------------------------------------------------------------------
    def _train_dirs(self) -> list[str]:
        return [d for d in ("train/tokens", "tokens") if self.files.listdir(d, ".parquet")]

    def _watched(self) -> list[str]:
        return ["loop-state.json", "loop-report.json", "report.json", "metrics.jsonl", "train/metrics.jsonl",
                "captures/rollouts.parquet", "captures/sessions", "captures/flows.mitm", "trajectories",
                *self._train_dirs()]

    def decode(self) -> Any:
        if self._decode is None:
            model = self.tokenizer_dir
            if model is None:
                from polar_core.paths import model_dir_for

                cfg = (self.files.json("loop-state.json") or {}).get("config") or (self.files.json("report.json") or {}).get("config") or {}
                name = (cfg.get("model") or {}).get("name") if isinstance(cfg.get("model"), dict) else cfg.get("model")
                if not name:
                    traj = self._trajectory_files()
                    df = self.files.parquet(f"trajectories/{traj[0]}", columns=["served_model"]) if traj else None
                    name = df["served_model"][0] if df is not None and df.height and "served_model" in df.columns else None
                model = model_dir_for(name)
            self._decode = tokenizer_decoder(model) or False
        return self._decode or None

    def _trajectory_files(self) -> list[str]:
        return [n for n in self.files.listdir("trajectories", ".parquet") if n.startswith("step-")]

    def _session_files(self) -> list[str]:
        return [n[:-6] for n in self.files.listdir("captures/sessions", ".jsonl") if valid_session_id(n[:-6])]

    def records(self, sid: str) -> list[dict[str, Any]]:
        if not valid_session_id(sid):
            return []
        recs = [r for r in self.files.capture_records(f"captures/sessions/{sid}.jsonl") if r.get("record_type", "call") == "call"]
        return sorted(recs, key=lambda r: (r.get("call_index") or 0, r.get("t_request_in") or 0))

    def drift_rows(self, sid: str) -> list[dict[str, Any]]:
        sig = self.files.signature([f"captures/sessions/{sid}.jsonl"])
        hit = self._drift.get(sid)
        if hit is None or hit[0] != sig:
            hit = (sig, session_drift(self.records(sid)))
            self._drift[sid] = hit
        return hit[1]

    def token_record(self) -> tuple[Any, dict[str, str]]:
        """The trainer's per-token record (every kept batch) and the sequences it names as left out."""
        import polars as pl

        frames, left_out = [], {}
        for d in self._train_dirs():
            for name in self.files.listdir(d, ".parquet"):
                df = self.files.parquet(f"{d}/{name}")
                if df is not None:
                    frames.append(df)
            for name in self.files.listdir(d, ".json"):
                left_out.update((self.files.json(f"{d}/{name}") or {}).get("left_out") or {})
        return (pl.concat(frames, how="diagonal_relaxed") if frames else None), left_out

    def trained_steps(self) -> set[int]:
        steps = (self.files.json("loop-state.json") or {}).get("steps") or (self.files.json("loop-report.json") or {}).get("steps") or []
        done = {s["step"] for s in steps if (s.get("train") or {}).get("updated")}
        demo = (self.files.json("report.json") or {}).get("training") or []  # a demo report without loop records
        return done | {t["iteration"] for t in demo if t.get("push") and t.get("iteration") is not None}

    # -- the pages' data -------------------------------------------------------------------------
    def refresh(self) -> bool:
        """Reload the run page's data if anything it reads changed; True when it did."""
        sig = self.files.signature(self._watched())
        if sig == self._sig and self.summary:
            return False
        self._sig = sig
        rollouts = self.files.parquet("captures/rollouts.parquet")
        ids = [s for s in (rollouts["session_id"].to_list() if rollouts is not None else []) if valid_session_id(s or "")]
        ids += [s for s in self._session_files() if s not in set(ids)]
        self.sample_ids = list(dict.fromkeys(ids))
        import polars as pl

        drift_rows = [r for sid in self._session_files() for r in self.drift_rows(sid)]
        drift = pl.DataFrame({"session_id": [r["session_id"] for r in drift_rows], "cause": [r["cause"] for r in drift_rows]},
                             schema={"session_id": pl.String, "cause": pl.String})
        self._rollouts = rollouts
        self._load_trajectories()
        self._record, self._left_out = self.token_record()
        self._trained_steps = self.trained_steps()
        record = self._record
        trained = set(record["session_id"].unique().to_list()) if record is not None and record.height else set()
        self.summary = build_summary(self.files, rollouts, drift, self.sample_ids, trained)
        self.summary["version"] = abs(hash(sig))  # what the served page compares to redraw
        self.flows.refresh()
        return True

    def sample(self, i: int) -> dict[str, Any] | None:
        if not self.summary:
            self.refresh()
        if not 0 <= i < len(self.sample_ids):
            return None
        import polars as pl

        sid = self.sample_ids[i]
        row = None
        if self._rollouts is not None:
            hit = self._rollouts.filter(pl.col("session_id") == sid)
            row = hit.to_dicts()[0] if hit.height else None
        trajectories = [r for df in self._traj_by_session.get(sid, []) for r in df.to_dicts()]
        tokens: dict[str, Any] = {}
        if self._record is not None and self._record.height:
            mine = self._record.filter(pl.col("session_id") == sid)
            for tid, part in mine.group_by("trajectory_id"):
                tokens[tid[0] if isinstance(tid, tuple) else tid] = part.sort("position").to_dict(as_series=False)
        return build_sample(self.files, sid, row, self.records(sid), trajectories, tokens, self._left_out,
                            self._trained_steps, self.flows, self.decode(), drift=self.drift_rows(sid))

    def _load_trajectories(self) -> None:
        """Every step's sequences, grouped by sample (one read of each file per change)."""
        sig = self.files.signature(["trajectories", *(f"trajectories/{n}" for n in self._trajectory_files())])
        if sig == self._traj_sig:
            return
        self._traj_sig, self._traj_by_session = sig, {}
        for name in self._trajectory_files():
            df = self.files.parquet(f"trajectories/{name}")
            if df is None or "session_id" not in df.columns:
                continue
            df = df.select([c for c in TRAJ_COLUMNS if c in df.columns])
            for key, part in df.group_by("session_id"):
                self._traj_by_session.setdefault(key[0] if isinstance(key, tuple) else key, []).append(part)


def load(root: str | Path, tokenizer: str | None = None) -> RunView:
    view = RunView(root, tokenizer)
    view.refresh()
    return view
