"""The Grafana dashboard for hetrain's metrics, built with grafana-foundation-sdk.

The JSON ships inside the package (hetrain/data/dashboard.json, package data); `hetrain dashboard
--out hetrain.json` writes it for users to import. `python -m hetrain.metrics.dashboard` rewrites
that file in a source checkout; it needs grafana-foundation-sdk, from the `dev` extra
(`pip install -e '.[dev]'`). Every panel's PromQL uses only series from hetrain.metrics.names and
the variables $job, $rank and $device.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "data" / "dashboard.json"   # the shipped file: package data
CHECKOUT = Path(__file__).resolve().parents[2]   # the repository, when this hetrain is a source checkout
UID = "hetrain-run"
SEL = 'job=~"$job", rank=~"$rank", device=~"$device"'
RATE = "[$__rate_interval]"


def _rate(name: str) -> str:
    return f"rate({name}{{{SEL}}}{RATE})"


STEP_TIME = f"sum by (rank) ({_rate('hetrain_step_seconds_sum')})"

CARRIED = ("hetrain_restarts_total",)
"""Counters a restarted process carries on from the elastic agent's count (never reset): read as values.
Every other counter starts again at zero in a restarted process, so panels read them through
rate() or increase(), which count a reset as one."""


def _events(name: str) -> str:
    """Job-wide events in each interval (every rank counts the same events: the largest count of any
    rank), from per-process counters that a restart resets."""
    return f"max by (job) (increase({name}{{{SEL}}}{RATE}))"


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str


@dataclass(frozen=True)
class PanelSpec:
    title: str
    unit: str
    queries: tuple[Query, ...]
    stacked: bool = False
    repeat: str | None = None
    description: str = ""


ROWS: tuple[tuple[str, tuple[PanelSpec, ...]], ...] = (
    ("Throughput and split", (
        PanelSpec("Samples/s per rank", "none", (
            Query(f"sum by (rank, device) ({_rate('hetrain_samples_total')})", "rank {{rank}} {{device}}"),)),
        PanelSpec("Items/s per rank", "none", (
            Query(f"sum by (rank, device) ({_rate('hetrain_items_total')})", "rank {{rank}} {{device}}"),)),
        PanelSpec("Share of the global batch", "percentunit", (
            Query(f"hetrain_share_ratio{{{SEL}}}", "rank {{rank}} {{device}}"),)),
        PanelSpec("Split changes", "none", (
            Query(_events("hetrain_split_changes_total"), "split changes"),),
            description="Times the balancer re-split the global batch in each interval (a count that a "
                        "restart of the workers does not reset)."),
    )),
    ("Where the time goes", (
        PanelSpec("Step time of rank $rank by cause", "percentunit", (
            Query(f"sum by (rank) ({_rate('hetrain_compute_seconds_total')}) / {STEP_TIME}", "compute"),
            Query(f"sum by (rank, cause) ({_rate('hetrain_wait_seconds_total')}) / on (rank) group_left {STEP_TIME}",
                  "waiting on {{cause}}"),
            Query(f"sum by (rank) ({_rate('hetrain_script_seconds_total')}) / {STEP_TIME}", "script"),
        ), stacked=True, repeat="rank",
            description="Fraction of the step spent computing, waiting on other ranks (with the gradient "
                        "communication backward did not hide), waiting for data, in the checkpoint service, and in "
                        "the script's own code between steps (logging, evaluation)."),
        PanelSpec("Idle fraction per rank", "percentunit", (
            Query(f"1 - sum by (rank) ({_rate('hetrain_compute_seconds_total')}) / {STEP_TIME}", "rank {{rank}}"),),
            description="Fraction of the step each rank's device does not compute: waiting on the other ranks, "
                        "for data or a checkpoint, and the script's own time (Session.idle_fraction)."),
        PanelSpec("Step time: predicted and measured", "s", (
            Query(f"{STEP_TIME} / sum by (rank) ({_rate('hetrain_step_seconds_count')})", "measured rank {{rank}}"),
            Query(f"hetrain_predicted_step_seconds{{{SEL}}}", "predicted rank {{rank}}"),
        ), description="Predicted: the plan's figure for the plan's split; it is not updated when the balancer "
                       "re-splits the global batch."),
        PanelSpec("MFU per rank", "percentunit", (
            Query(f"hetrain_mfu_ratio{{{SEL}}}", "rank {{rank}} {{device}}"),),
            description="Model FLOPs over wall time against each device's own datasheet peak in its precision."),
    )),
    ("Memory and communication", (
        PanelSpec("Memory per rank", "bytes", (
            Query(f"hetrain_memory_bytes{{{SEL}}}", "rank {{rank}} {{kind}}"),),
            description="CUDA allocator figures on GPU ranks; resident set (rss) of the process on CPU ranks."),
        PanelSpec("GPU memory used (NVML)", "bytes", (
            Query(f"hetrain_gpu_memory_used_bytes{{{SEL}}}", "rank {{rank}} gpu {{gpu}}"),)),
        PanelSpec("Gradient communication sent", "Bps", (
            Query(f"sum by (rank, level) ({_rate('hetrain_comm_sent_bytes_total')})", "rank {{rank}} {{level}}"),)),
        PanelSpec("NVLink traffic", "Bps", (
            Query(f"sum by (rank) ({_rate('hetrain_gpu_nvlink_sent_bytes_total')})", "rank {{rank}} sent"),
            Query(f"sum by (rank) ({_rate('hetrain_gpu_nvlink_received_bytes_total')})", "rank {{rank}} received"),
        )),
    )),
    ("Training", (
        PanelSpec("Loss", "none", (Query(f"max by (job) (hetrain_loss{{{SEL}}})", "loss"),)),
        PanelSpec("Gradient norm", "none", (Query(f"max by (job) (hetrain_grad_norm{{{SEL}}})", "grad norm"),)),
        PanelSpec("Loss scale and skipped steps", "none", (
            Query(f"max by (job) (hetrain_loss_scale{{{SEL}}})", "loss scale"),
            Query(_events("hetrain_skipped_steps_total"), "skipped steps"),
        ), description="Skipped steps: updates skipped for a non-finite gradient in each interval."),
        PanelSpec("Restarts and checkpoints", "none", (
            Query(f"max by (job) (hetrain_restarts_total{{{SEL}}})", "restarts (so far)"),
            Query(_events("hetrain_checkpoints_written_total"), "checkpoints written"),
        ), description="Restarts: the elastic agent's count so far. Checkpoints: those written in each interval."),
        PanelSpec("Checkpoint seconds (mean)", "s", (
            Query(f"max by (job) ({_rate('hetrain_checkpoint_blocking_seconds_sum')} / "
                  f"{_rate('hetrain_checkpoint_blocking_seconds_count')})", "blocking"),
            Query(f"max by (job) ({_rate('hetrain_checkpoint_save_seconds_sum')} / "
                  f"{_rate('hetrain_checkpoint_save_seconds_count')})", "until committed"),
        ), description="Mean seconds of the saves in each interval, of the slowest rank: the checkpointer's own "
                       "blocking part (snapshot to memory) and until the save was committed on disk."),
    )),
    ("GPU (NVML)", (
        PanelSpec("GPU utilisation", "percentunit", (
            Query(f"hetrain_gpu_utilization_ratio{{{SEL}}}", "rank {{rank}} gpu {{gpu}}"),)),
        PanelSpec("GPU power", "watt", (Query(f"hetrain_gpu_power_watts{{{SEL}}}", "rank {{rank}} gpu {{gpu}}"),)),
        PanelSpec("GPU temperature", "celsius", (
            Query(f"hetrain_gpu_temperature_celsius{{{SEL}}}", "rank {{rank}} gpu {{gpu}}"),)),
    )),
)


def build() -> dict:
    """The dashboard as a JSON-ready dict."""
    import json

    from grafana_foundation_sdk.builders import common as cb
    from grafana_foundation_sdk.builders.dashboard import Dashboard, DatasourceVariable, QueryVariable, Row
    from grafana_foundation_sdk.builders.prometheus import Dataquery
    from grafana_foundation_sdk.builders.timeseries import Panel
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models.common import LegendDisplayMode, LegendPlacement, StackingMode, TooltipDisplayMode
    from grafana_foundation_sdk.models.dashboard import DataSourceRef, VariableRefresh

    ds = DataSourceRef(type_val="prometheus", uid="${datasource}")

    def variable(name: str, query: str, multi: bool) -> QueryVariable:
        v = (QueryVariable(name).label(name).datasource(ds).query(query).refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
             .multi(multi).include_all(multi))
        return v.all_value(".*") if multi else v

    board = (
        Dashboard("hetrain: a mixed-device run").uid(UID).tags(["hetrain", "generated"])
        .description("Per-rank throughput, split, waiting, memory, communication and training figures of a hetrain job. "
                     "Generated by `python -m hetrain.metrics.dashboard`.")
        .refresh("10s").time("now-30m", "now")
        .with_variable(DatasourceVariable("datasource").label("Prometheus").type("prometheus"))
        .with_variable(variable("job", "label_values(hetrain_rank_info, job)", False))
        .with_variable(variable("rank", 'label_values(hetrain_rank_info{job=~"$job"}, rank)', True))
        .with_variable(variable("device", 'label_values(hetrain_rank_info{job=~"$job"}, device)', True))
    )
    legend = cb.VizLegendOptions().show_legend(True).display_mode(LegendDisplayMode.LIST).placement(LegendPlacement.BOTTOM)
    tooltip = cb.VizTooltipOptions().mode(TooltipDisplayMode.MULTI)
    ids = iter(range(1, 1000))
    for row_title, panels in ROWS:
        board = board.with_row(Row(row_title).id(next(ids)))
        for spec in panels:
            panel = (Panel().id(next(ids)).title(spec.title).unit(spec.unit).datasource(ds).height(8).span(12)
                     .legend(legend).tooltip(tooltip))
            if spec.description:
                panel = panel.description(spec.description)
            if spec.stacked:
                panel = panel.stacking(cb.StackingConfig().mode(StackingMode.NORMAL)).fill_opacity(60)
            if spec.repeat:
                panel = panel.repeat(spec.repeat).repeat_direction("h")
            for i, q in enumerate(spec.queries):
                panel = panel.with_target(Dataquery().expr(q.expr).legend_format(q.legend).ref_id(chr(ord("A") + i))
                                          .datasource(ds))
            board = board.with_panel(panel)
    return json.loads(JSONEncoder(sort_keys=True, indent=2).encode(board.build()))


def render() -> str:
    import json

    return json.dumps(build(), indent=2, sort_keys=True) + "\n"


def shipped() -> str:
    """The dashboard JSON shipped in the package: what `hetrain dashboard` prints."""
    from importlib import resources

    return resources.files("hetrain").joinpath("data", "dashboard.json").read_text(encoding="utf-8")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m hetrain.metrics.dashboard", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None,
                        help="where to write the JSON (default: hetrain/data/dashboard.json of this source checkout)")
    args = parser.parse_args(argv)
    out = args.out
    if out is None:
        if not (CHECKOUT / "pyproject.toml").is_file():   # installed: never write into site-packages
            parser.exit(2, f"{parser.prog}: error: this hetrain is installed, not a source checkout; fix: "
                           "`hetrain dashboard --out hetrain.json` writes the shipped dashboard, or give --out\n")
        out = OUT
    try:
        text = render()
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] != "grafana_foundation_sdk":
            raise
        parser.exit(2, f"{parser.prog}: error: generating the dashboard needs grafana-foundation-sdk, in the `dev` "
                       "extra; fix: pip install -e '.[dev]' (`hetrain dashboard` prints the shipped one)\n")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
