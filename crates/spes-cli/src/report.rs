//! The demo's report: `report.md` with PNG plots of per-node training loss, global validation
//! loss and expert load per layer, drawn from the server's and the nodes' `metrics.jsonl`.

use anyhow::{Context, Result};
use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;
use spes_sync::RoundSettings;
use spes_train::metrics::{self, DemoSummary, NodeLine, RoundRecord, SyncRecord};
use std::path::Path;

/// Bytes in a MiB, for the report's figures.
const MIB: f64 = (1u64 << 20) as f64;

/// DejaVu Sans (see assets/DEJAVU-LICENSE), so plots have text without system fonts.
const FONT: &[u8] = include_bytes!("../assets/DejaVuSans.ttf");

pub use spes_train::metrics::RoundCost;

/// Per-round sync costs from the nodes' `metrics.jsonl` (`sync` records), by round, with the
/// server's part from its own log (`server/metrics.jsonl` beside the nodes, when there).
pub fn round_costs(out: &Path, peers: &[u64]) -> Vec<RoundCost> {
    let mut by_round: std::collections::BTreeMap<u64, Vec<SyncRecord>> = Default::default();
    for p in peers {
        for line in metrics::read::<NodeLine>(&out.join(format!("node-{p}/metrics.jsonl"))) {
            if let NodeLine::Sync(r) = line {
                by_round.entry(r.round).or_default().push(r);
            }
        }
    }
    let server: Vec<RoundRecord> = metrics::read(&out.join("server/metrics.jsonl"));
    by_round
        .into_iter()
        .map(|(round, rs)| {
            let mean = |f: fn(&SyncRecord) -> f64| rs.iter().map(f).sum::<f64>() / rs.len() as f64;
            let close = server
                .iter()
                .find(|r| r.round == round)
                .and_then(|r| r.close.as_ref());
            RoundCost {
                round,
                nodes: rs.len(),
                compute_s: mean(|r| r.compute_s),
                sync_s: mean(|r| r.sync_s),
                idle_s: mean(|r| r.idle_s),
                bytes_up: mean(|r| r.bytes_up as f64),
                bytes_down: mean(|r| r.bytes_down as f64),
                bytes_written: mean(|r| r.bytes_written as f64),
                server_aggregation_s: close.map(|c| c.aggregation_s),
                server_bytes_written: close.map(|c| c.bytes_written),
            }
        })
        .collect()
}

fn plot_err<E: std::fmt::Display>(e: E) -> anyhow::Error {
    anyhow::anyhow!("plotting failed: {e}")
}

/// `(x, y)` bounds with a little headroom.
fn bounds(series: &[Vec<(f64, f64)>]) -> ((f64, f64), (f64, f64)) {
    let pts = series.iter().flatten();
    let (mut x1, mut y0, mut y1) = (1.0f64, f64::MAX, f64::MIN);
    for &(x, y) in pts {
        x1 = x1.max(x);
        y0 = y0.min(y);
        y1 = y1.max(y);
    }
    if y0 > y1 {
        (y0, y1) = (0.0, 1.0);
    }
    let pad = ((y1 - y0) * 0.05).max(1e-3);
    ((0.0, x1 * 1.02), (y0 - pad, y1 + pad))
}

type Chart<'a, 'b> =
    ChartContext<'a, BitMapBackend<'b>, Cartesian2d<RangedCoordf64, RangedCoordf64>>;

/// Draws each named series as a coloured line with a legend entry.
fn draw_lines(chart: &mut Chart, series: &[(String, Vec<(f64, f64)>)]) -> Result<()> {
    for (i, (label, points)) in series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))
            .map_err(plot_err)?
            .label(label.clone())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
    }
    Ok(())
}

fn draw_legend<'a, 'b: 'a>(chart: &mut Chart<'a, 'b>) -> Result<()> {
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(plot_err)?;
    Ok(())
}

fn line_chart(
    area: &DrawingArea<BitMapBackend, plotters::coord::Shift>,
    title: &str,
    x_desc: &str,
    y_desc: &str,
    series: &[(String, Vec<(f64, f64)>)],
) -> Result<()> {
    let data: Vec<Vec<(f64, f64)>> = series.iter().map(|(_, s)| s.clone()).collect();
    let ((x0, x1), (y0, y1)) = bounds(&data);
    let mut chart = ChartBuilder::on(area)
        .caption(title, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(55)
        .build_cartesian_2d(x0..x1, y0..y1)
        .map_err(plot_err)?;
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .y_desc(y_desc)
        .x_label_formatter(&|x| format!("{:.0}k", x / 1e3))
        .draw()
        .map_err(plot_err)?;
    draw_lines(&mut chart, series)?;
    draw_legend(&mut chart)
}

/// Writes one line chart of named `(tokens, loss)` series to `path`.
pub fn loss_plot(path: &Path, title: &str, series: &[(String, Vec<(f64, f64)>)]) -> Result<()> {
    let _ = plotters::style::register_font("sans-serif", FontStyle::Normal, FONT);
    let root = BitMapBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(plot_err)?;
    line_chart(&root, title, "training tokens", "loss (nats/token)", series)?;
    root.present().map_err(plot_err)
}

/// The expert load of the newest scored model as a layer × expert heatmap, each column
/// labelled with its owner (`P<peer>`) when the run has owners.
fn load_heatmap(path: &Path, load: &[Vec<f64>], owners: &[usize]) -> Result<()> {
    let (layers, experts) = (
        load.len().max(1),
        load.first().map_or(1, |l| l.len()).max(1),
    );
    let root = BitMapBackend::new(path, (900, 140 + 36 * layers as u32)).into_drawing_area();
    root.fill(&WHITE).map_err(plot_err)?;
    let (lo, hi) = load
        .iter()
        .flatten()
        .fold((f64::MAX, f64::MIN), |(a, b), &v| (a.min(v), b.max(v)));
    let (lo, hi) = if lo <= hi {
        (lo, hi.max(lo + 1e-9))
    } else {
        (0.0, 1.0)
    };
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!("Expert load (final model, validation tokens): {lo:.3} light to {hi:.3} dark; uniform {:.3}", 1.0 / experts as f64),
            ("sans-serif", 18),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(
            // A segmented range of 0..n-1 has n segments, each labelled at its centre.
            (0..experts as i32 - 1).into_segmented(),
            (0..layers as i32 - 1).into_segmented(),
        )
        .map_err(plot_err)?;
    let owner_of = |e: i32| {
        owners.get(e as usize).map_or(String::new(), |&o| match o {
            spes_sync::UNOWNED => "frozen".to_string(),
            o => format!("P{o}"),
        })
    };
    let at = |v: &SegmentValue<i32>| match v {
        SegmentValue::Exact(i) | SegmentValue::CenterOf(i) => Some(*i),
        SegmentValue::Last => None,
    };
    chart
        .configure_mesh()
        .disable_mesh()
        .x_desc(if owners.is_empty() {
            "expert"
        } else {
            "expert (owner)"
        })
        .y_desc("layer")
        .x_labels(experts)
        .y_labels(layers)
        .x_label_formatter(&|x| match at(x) {
            Some(e) if owners.is_empty() => e.to_string(),
            Some(e) => format!("{e} {}", owner_of(e)),
            None => String::new(),
        })
        .y_label_formatter(&|y| at(y).map_or(String::new(), |l| l.to_string()))
        .draw()
        .map_err(plot_err)?;
    let cells = load.iter().enumerate().flat_map(|(l, row)| {
        row.iter().enumerate().map(move |(e, &v)| {
            let t = (v - lo) / (hi - lo);
            // Light yellow to dark blue.
            let mix = |a: f64, b: f64| (a + (b - a) * t).round() as u8;
            let color = RGBColor(mix(255.0, 8.0), mix(247.0, 48.0), mix(188.0, 107.0));
            let (e, l) = (e as i32, l as i32);
            Rectangle::new(
                [
                    (SegmentValue::Exact(e), SegmentValue::Exact(l)),
                    (SegmentValue::Exact(e + 1), SegmentValue::Exact(l + 1)),
                ],
                color.filled(),
            )
        })
    });
    chart.draw_series(cells).map_err(plot_err)?;
    root.present().map_err(plot_err)
}

/// Each round's mean compute, sync and idle seconds (left) and bytes per node (right).
fn sync_plot(path: &Path, costs: &[RoundCost]) -> Result<()> {
    let root = BitMapBackend::new(path, (1300, 460)).into_drawing_area();
    root.fill(&WHITE).map_err(plot_err)?;
    let (left, right) = root.split_horizontally(650);
    let series = |f: fn(&RoundCost) -> f64| {
        costs
            .iter()
            .map(|c| (c.round as f64, f(c)))
            .collect::<Vec<_>>()
    };
    let seconds = vec![
        ("compute".to_string(), series(|c| c.compute_s)),
        ("sync".to_string(), series(|c| c.sync_s)),
        ("idle".to_string(), series(|c| c.idle_s)),
    ];
    let bytes = vec![
        ("up".to_string(), series(|c| c.bytes_up / MIB)),
        ("down".to_string(), series(|c| c.bytes_down / MIB)),
        (
            "node written".to_string(),
            series(|c| c.bytes_written / MIB),
        ),
        (
            "server written".to_string(),
            costs
                .iter()
                .filter_map(|c| Some((c.round as f64, c.server_bytes_written? as f64 / MIB)))
                .collect(),
        ),
    ];
    for (area, title, y, s) in [
        (
            &left,
            "Seconds per round (mean over nodes)",
            "seconds",
            &seconds,
        ),
        (&right, "MiB per round (per node; server)", "MiB", &bytes),
    ] {
        let data: Vec<Vec<(f64, f64)>> = s.iter().map(|(_, p)| p.clone()).collect();
        let ((x0, x1), (_, y1)) = bounds(&data);
        let mut chart = ChartBuilder::on(area)
            .caption(title, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(55)
            .build_cartesian_2d(x0..x1, 0.0..y1.max(1e-3))
            .map_err(plot_err)?;
        chart
            .configure_mesh()
            .x_desc("round")
            .y_desc(y)
            .x_label_formatter(&|x| format!("{x:.0}"))
            .draw()
            .map_err(plot_err)?;
        draw_lines(&mut chart, s)?;
        draw_legend(&mut chart)?;
    }
    root.present().map_err(plot_err)
}

/// Writes `loss.png`, `expert_load.png`, `sync.png` and `report.md` under `out`.
/// The settings the rounds ran, run by run of rounds, with the bytes and utilization each run
/// measured and, for an adaptive run, why the server changed them.
fn settings_section(server: &[RoundRecord], costs: &[RoundCost]) -> String {
    let settings: Vec<(u64, RoundSettings)> = server
        .iter()
        .filter_map(|r| Some((r.round, r.close.as_ref()?.settings?)))
        .collect();
    if settings.is_empty() {
        return String::new();
    }
    let mut md = String::from("\n### Settings per round\n\n| rounds | wire and overlap | up + down per node and round | utilization |\n|---|---|---|---|\n");
    let mut start = 0;
    while start < settings.len() {
        let s = settings[start].1;
        let end = settings[start..]
            .iter()
            .position(|(_, x)| *x != s)
            .map_or(settings.len(), |k| start + k);
        let (first, last) = (settings[start].0, settings[end - 1].0);
        let of_run: Vec<&RoundCost> = costs
            .iter()
            .filter(|c| (first..=last).contains(&c.round))
            .collect();
        let k = of_run.len().max(1) as f64;
        let bytes = of_run
            .iter()
            .map(|c| c.bytes_up + c.bytes_down)
            .sum::<f64>()
            / k;
        let compute: f64 = of_run.iter().map(|c| c.compute_s).sum();
        let idle: f64 = of_run.iter().map(|c| c.idle_s).sum();
        md.push_str(&format!(
            "| {first}–{last} | {s} | {:.2} MiB | {:.1} % |\n",
            bytes / MIB,
            100.0 * metrics::utilization(compute, idle)
        ));
        start = end;
    }
    for r in server {
        let Some(c) = r.close.as_ref().and_then(|c| c.choice.as_ref()) else {
            continue;
        };
        if let Some(chosen) = &c.chose {
            md.push_str(&format!(
                "\nAfter round {}: {} from round {}, {}.\n",
                r.round, chosen.settings, chosen.from_round, chosen.reason
            ));
        }
    }
    md
}

pub fn write(out: &Path, summary: &DemoSummary, config_toml: &str) -> Result<()> {
    // Registering twice (a second report in one process) fails harmlessly.
    let _ = plotters::style::register_font("sans-serif", FontStyle::Normal, FONT);
    let server: Vec<RoundRecord> = metrics::read(&out.join("server/metrics.jsonl"));
    let nodes = &summary.nodes;

    let per_node: Vec<(String, Vec<(f64, f64)>)> = nodes
        .iter()
        .map(|n| {
            let rows =
                metrics::read::<NodeLine>(&out.join(format!("node-{}/metrics.jsonl", n.peer)));
            let pts = rows
                .iter()
                .filter_map(|r| match r {
                    NodeLine::Step(s) => Some((s.tokens as f64, s.losses.as_ref()?.loss)),
                    NodeLine::Sync(_) => None,
                })
                .collect();
            (format!("node {}", n.peer), pts)
        })
        .collect();
    let val: Vec<(f64, f64)> = server
        .iter()
        .filter_map(|r| Some((r.tokens as f64, r.val_loss?)))
        .collect();
    let loss_png = out.join("loss.png");
    {
        let root = BitMapBackend::new(&loss_png, (1300, 520)).into_drawing_area();
        root.fill(&WHITE).map_err(plot_err)?;
        let (left, right) = root.split_horizontally(650);
        line_chart(
            &left,
            "Training loss per node",
            "tokens seen by the node",
            "loss (nats/token)",
            &per_node,
        )?;
        let global = vec![("global model, validation".to_string(), val.clone())];
        line_chart(
            &right,
            "Global validation loss",
            "tokens, all nodes",
            "loss (nats/token)",
            &global,
        )?;
        root.present().map_err(plot_err)?;
    }

    let newest_load = server.iter().rev().find(|r| r.expert_load.is_some());
    let load: Vec<Vec<f64>> = newest_load
        .and_then(|r| r.expert_load.clone())
        .unwrap_or_default();
    let owners: Vec<usize> = newest_load.map(|r| r.owners.clone()).unwrap_or_default();
    load_heatmap(&out.join("expert_load.png"), &load, &owners)?;
    sync_plot(&out.join("sync.png"), &summary.round_costs)?;

    let merges: Vec<String> = server
        .iter()
        .filter_map(|r| {
            let c = r.close.as_ref()?;
            Some(format!(
                "round {} (step {}): α = {:.4}, {} experts merged",
                r.round,
                r.step,
                c.merge_alpha?,
                c.merges.len()
            ))
        })
        .collect();
    let f = |v: Option<f64>| v.map_or("n/a".into(), |x| format!("{x:.3}"));
    let n = |v: Option<u64>| v.map_or("n/a".into(), |x| x.to_string());
    let mut md = String::new();
    md.push_str("# spes demo: SPES on loopback\n\n");
    md.push_str(&format!(
        "One parameter server and {} nodes, each a separate process, trained the `tiny` preset \
         on the embedded corpus. Every node trained the shared parameters and its own experts only.\n\n",
        nodes.len()
    ));
    md.push_str("| | |\n|---|---|\n");
    md.push_str(&format!(
        "| initial validation loss | {} |\n",
        f(summary.initial_val_loss)
    ));
    md.push_str(&format!(
        "| final validation loss | {} |\n",
        f(summary.final_val_loss)
    ));
    md.push_str(&format!("| tokens (all nodes) | {} |\n", n(summary.tokens)));
    md.push_str(&format!("| rounds | {} |\n", n(summary.rounds)));
    md.push_str(&format!("| wall time | {:.0} s |\n\n", summary.wall_s));
    md.push_str(
        "| node | trainable params | optimizer state | bytes up | bytes down | peak RSS | s per step | idle share |\n",
    );
    md.push_str("|---|---|---|---|---|---|---|---|\n");
    let mib = |v: u64| v as f64 / MIB;
    for n in nodes {
        // Over the node's rounds: its training seconds per step, and the share it stood still.
        let syncs: Vec<SyncRecord> =
            metrics::read::<NodeLine>(&out.join(format!("node-{}/metrics.jsonl", n.peer)))
                .into_iter()
                .filter_map(|l| match l {
                    NodeLine::Sync(s) => Some(s),
                    NodeLine::Step(_) => None,
                })
                .collect();
        let compute: f64 = syncs.iter().map(|s| s.compute_s).sum();
        let idle: f64 = syncs.iter().map(|s| s.idle_s).sum();
        md.push_str(&format!(
            "| {} | {:.2} M | {:.1} MiB | {:.1} MiB | {:.1} MiB | {:.0} MiB | {:.3} | {:.1} % |\n",
            n.peer,
            n.trainable_params as f64 / 1e6,
            mib(n.optimizer_state_bytes),
            mib(n.bytes_up),
            mib(n.bytes_down),
            n.peak_rss_mb,
            compute / n.steps.max(1) as f64,
            100.0 * (1.0 - metrics::utilization(compute, idle)),
        ));
    }
    let costs = &summary.round_costs;
    md.push_str("\n## Sync cost\n\n*Sync* runs from a node's upload to its loaded model; *idle* is the time training stood still for it (with `sync.overlap`, only the wait for the result); *written* is what each role wrote to its disk (its own I/O counters). `sync.png` draws each round; `summary.json` (`round_costs`) holds the numbers.\n\n");
    let rounds = costs.len().max(1) as f64;
    let mean = |f: fn(&RoundCost) -> f64| costs.iter().map(f).sum::<f64>() / rounds;
    let mib = |b: f64| b / MIB;
    let (compute, idle) = (mean(|c| c.compute_s), mean(|c| c.idle_s));
    let node_total: f64 = costs.iter().map(|c| c.bytes_written * c.nodes as f64).sum();
    let server_total: u64 = costs.iter().filter_map(|c| c.server_bytes_written).sum();
    md.push_str("| per round, mean over rounds and nodes | |\n|---|---|\n");
    md.push_str(&format!(
        "| compute | {compute:.2} s |\n| sync | {:.2} s |\n| idle | {idle:.2} s |\n",
        mean(|c| c.sync_s)
    ));
    md.push_str(&format!(
        "| utilization (compute / (compute + idle)) | {:.1} % |\n",
        100.0 * metrics::utilization(compute, idle)
    ));
    md.push_str(&format!(
        "| up / down per node | {:.2} / {:.2} MiB |\n| server aggregation | {:.2} s |\n",
        mib(mean(|c| c.bytes_up)),
        mib(mean(|c| c.bytes_down)),
        mean(|c| c.server_aggregation_s.unwrap_or(0.0))
    ));
    md.push_str(&format!(
        "\nWritten over the run: server {:.0} MiB, nodes {:.0} MiB together ({:.1} MiB per round for the whole run).\n",
        mib(server_total as f64),
        mib(node_total),
        mib(server_total as f64 + node_total) / rounds,
    ));
    md.push_str(&settings_section(&server, costs));
    md.push_str("\n![sync cost per round](sync.png)\n");
    md.push_str("\n![loss](loss.png)\n\n![expert load](expert_load.png)\n\n## Expert merging\n\n");
    if merges.is_empty() {
        md.push_str("No merge rounds.\n");
    } else {
        for m in merges {
            md.push_str(&format!("- {m}\n"));
        }
    }
    md.push_str("\nNeighbours chosen per expert are in `server/metrics.jsonl` (`merges`).\n\n## Configuration\n\n```toml\n");
    md.push_str(config_toml);
    md.push_str("```\n");
    spes_data::shard::write_atomic(&out.join("report.md"), md.as_bytes()).context("report.md")
}

#[cfg(test)]
mod tests {
    use super::*;
    use spes_sync::Wire;
    use spes_train::metrics::{Chosen, RoundClose, SettingsChoice};

    #[test]
    fn the_settings_section_gives_each_run_of_rounds_its_bytes_and_the_reasons() {
        let lowrank = RoundSettings {
            wire: Wire::LowrankDelta,
            overlap: true,
            overlap_steps: 1,
        };
        let bf16 = RoundSettings {
            wire: Wire::Bf16Delta,
            overlap: false,
            overlap_steps: 0,
        };
        let record = |round: u64, s: RoundSettings, chose: Option<RoundSettings>| RoundRecord {
            round,
            close: Some(RoundClose {
                settings: Some(s),
                choice: chose.map(|settings| SettingsChoice {
                    chose: Some(Chosen {
                        from_round: round + 2,
                        settings,
                        reason: "because".into(),
                    }),
                    ..SettingsChoice::default()
                }),
                ..RoundClose::default()
            }),
            ..RoundRecord::default()
        };
        let server = vec![
            record(1, lowrank, None),
            record(2, lowrank, Some(bf16)),
            record(3, lowrank, None),
            record(4, bf16, None),
        ];
        let cost = |round: u64, bytes: f64, idle_s: f64| RoundCost {
            round,
            nodes: 2,
            compute_s: 1.0,
            sync_s: 0.5,
            idle_s,
            bytes_up: bytes,
            bytes_down: bytes,
            bytes_written: 0.0,
            server_aggregation_s: None,
            server_bytes_written: None,
        };
        let costs = vec![
            cost(1, MIB / 2.0, 0.0),
            cost(2, MIB / 2.0, 0.0),
            cost(3, MIB / 2.0, 1.0),
            cost(4, 4.0 * MIB, 1.0),
        ];
        let md = settings_section(&server, &costs);
        assert!(
            md.contains("| 1–3 | lowrank_delta, overlap 1 step | 1.00 MiB | 75.0 % |"),
            "{md}"
        );
        assert!(
            md.contains("| 4–4 | bf16_delta, no overlap | 8.00 MiB | 50.0 % |"),
            "{md}"
        );
        assert!(
            md.contains("After round 2: bf16_delta, no overlap from round 4, because."),
            "{md}"
        );
        assert_eq!(settings_section(&[], &costs), "");
    }
}
