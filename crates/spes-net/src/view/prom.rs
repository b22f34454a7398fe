//! `/metrics`: a [`RunView`] in the Prometheus text exposition format (0.0.4), written by the
//! `prometheus` crate (TiKV's client, the most used in Rust, without its protobuf feature).
//! Families are registered afresh for each scrape from the snapshot, so nothing here keeps
//! state.

use super::{NodeView, RunView};
use prometheus::{Encoder, GaugeVec, IntCounterVec, Opts, Registry, TextEncoder};

/// Gauges and counters with the labels given, registered on `reg`.
struct Families<'a> {
    reg: &'a Registry,
}

impl Families<'_> {
    fn gauge(&self, name: &str, help: &str, labels: &[&str]) -> GaugeVec {
        let g = GaugeVec::new(Opts::new(name, help), labels).expect("a valid metric name");
        self.reg
            .register(Box::new(g.clone()))
            .expect("registered once");
        g
    }

    fn counter(&self, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
        let c = IntCounterVec::new(Opts::new(name, help), labels).expect("a valid metric name");
        self.reg
            .register(Box::new(c.clone()))
            .expect("registered once");
        c
    }
}

/// The server's metrics: the run's and every node's.
pub fn render(view: &RunView) -> String {
    let reg = Registry::new();
    let f = Families { reg: &reg };
    let r = &view.run;
    let run = |name: &str, help: &str, v: f64| {
        f.gauge(name, help, &[])
            .with_label_values::<&str>(&[])
            .set(v)
    };
    run("spes_round", "The newest published round.", r.round as f64);
    run(
        "spes_open_round",
        "The round nodes are training.",
        r.open_round as f64,
    );
    run(
        "spes_final_round",
        "The run's last round.",
        r.final_round as f64,
    );
    run(
        "spes_tokens",
        "Training tokens of the run up to the newest round.",
        r.tokens as f64,
    );
    run(
        "spes_members",
        "Members of the open round.",
        view.nodes.iter().filter(|n| n.member).count() as f64,
    );
    run(
        "spes_live_members",
        "Members of the open round whose lease is current.",
        view.nodes
            .iter()
            .filter(|n| n.member && n.lease_age_s.is_some_and(|a| a < r.lease_s))
            .count() as f64,
    );
    run(
        "spes_uptime_seconds",
        "Seconds since this server process started.",
        r.uptime_s,
    );
    if let Some(v) = r.val_loss {
        run(
            "spes_val_loss",
            "Validation loss of the newest scored global model.",
            v,
        );
    }
    if let Some(p) = view.rounds.last() {
        run(
            "spes_round_seconds",
            "Duration of the newest round.",
            p.round_s,
        );
        run(
            "spes_aggregation_seconds",
            "Closing the newest round: averaging, merging.",
            p.aggregation_s,
        );
        run(
            "spes_round_bytes_in",
            "Bytes uploaded in the newest round.",
            p.bytes_in as f64,
        );
        run(
            "spes_round_bytes_out",
            "Bytes fetched in the newest round.",
            p.bytes_out as f64,
        );
    }
    let c = &view.counters;
    run(
        "spes_publish_seconds",
        "Writing the newest round durably.",
        c.publish_s,
    );
    let count = |name: &str, help: &str, v: u64| {
        f.counter(name, help, &[])
            .with_label_values::<&str>(&[])
            .inc_by(v)
    };
    count("spes_joins_total", "Nodes admitted into the run.", c.joins);
    count(
        "spes_evictions_total",
        "Members evicted after their lease expired.",
        c.evictions,
    );
    count(
        "spes_bad_reports_total",
        "Node reports dropped as invalid.",
        c.bad_reports,
    );
    count(
        "spes_store_links_total",
        "Fetches answered with a presigned URL of the run's store.",
        c.links,
    );
    count(
        "spes_store_fallbacks_total",
        "Fetches the store failed for a node, served by the server instead.",
        c.fallbacks,
    );
    let refusals = f.counter(
        "spes_refusals_total",
        "Refused calls by reason.",
        &["reason"],
    );
    for (reason, n) in &c.refusals {
        refusals.with_label_values(&[reason.as_str()]).inc_by(*n);
    }
    let peer = f.gauge(
        "spes_node_lease_age_seconds",
        "Seconds since the node renewed its lease.",
        &["peer"],
    );
    let member = f.gauge(
        "spes_node_member",
        "1 if the node is a member of the open round.",
        &["peer"],
    );
    let experts = f.gauge(
        "spes_node_experts",
        "Experts the node trains in the open round.",
        &["peer"],
    );
    let uploads = f.counter(
        "spes_node_uploads_total",
        "Uploads accepted from the node.",
        &["peer"],
    );
    let bytes_in = f.counter(
        "spes_node_upload_bytes_total",
        "Bytes the node uploaded.",
        &["peer"],
    );
    let bytes_out = f.counter(
        "spes_node_fetch_bytes_total",
        "Bytes the node fetched.",
        &["peer"],
    );
    let refused = f.counter(
        "spes_node_refusals_total",
        "The node's refused calls.",
        &["peer"],
    );
    for n in &view.nodes {
        let p = n.peer.to_string();
        let l = [p.as_str()];
        if let Some(a) = n.lease_age_s {
            peer.with_label_values(&l).set(a);
        }
        member
            .with_label_values(&l)
            .set(if n.member { 1.0 } else { 0.0 });
        experts.with_label_values(&l).set(n.experts.len() as f64);
        uploads.with_label_values(&l).inc_by(n.uploads);
        bytes_in.with_label_values(&l).inc_by(n.bytes_in);
        bytes_out.with_label_values(&l).inc_by(n.bytes_out);
        refused.with_label_values(&l).inc_by(n.refusals);
    }
    node_families(&f, &view.nodes);
    encode(&reg)
}

/// A node's own `/metrics`: what it reports to the server.
pub fn render_nodes(nodes: &[NodeView]) -> String {
    let reg = Registry::new();
    node_families(&Families { reg: &reg }, nodes);
    encode(&reg)
}

/// What nodes report: step, rate, loss parts and their newest sync.
fn node_families(f: &Families, nodes: &[NodeView]) {
    let step = f.gauge(
        "spes_node_step",
        "The node's newest logged step.",
        &["peer"],
    );
    let tokens = f.gauge("spes_node_tokens", "Tokens the node trained on.", &["peer"]);
    let tps = f.gauge(
        "spes_node_tokens_per_second",
        "The node's training rate.",
        &["peer"],
    );
    let loss = f.gauge(
        "spes_node_loss",
        "The node's newest training loss, by part.",
        &["peer", "part"],
    );
    let lr = f.gauge("spes_node_lr", "The node's learning rate.", &["peer"]);
    let idle = f.gauge(
        "spes_node_idle_share",
        "Share of the node's newest round it stood still.",
        &["peer"],
    );
    let sync_s = f.gauge(
        "spes_node_sync_seconds",
        "The node's newest sync, upload to loaded model.",
        &["peer"],
    );
    let up = f.gauge(
        "spes_node_sync_bytes_up",
        "Bytes the node sent in its newest sync.",
        &["peer"],
    );
    let down = f.gauge(
        "spes_node_sync_bytes_down",
        "Bytes the node received in its newest sync.",
        &["peer"],
    );
    let age = f.gauge(
        "spes_node_report_age_seconds",
        "Seconds since the node's newest report.",
        &["peer"],
    );
    for n in nodes {
        let Some(r) = &n.report else { continue };
        let p = n.peer.to_string();
        let l = [p.as_str()];
        step.with_label_values(&l).set(r.step as f64);
        tokens.with_label_values(&l).set(r.tokens as f64);
        tps.with_label_values(&l).set(r.tokens_per_s);
        lr.with_label_values(&l).set(r.losses.lr);
        let parts = [
            ("loss", r.losses.loss),
            ("ce", r.losses.ce),
            ("z_loss", r.losses.z_loss),
            ("lb_loss", r.losses.lb_loss),
            ("router_z_loss", r.losses.router_z_loss),
        ];
        for (part, v) in parts {
            loss.with_label_values(&[p.as_str(), part]).set(v);
        }
        if let Some(s) = &r.sync {
            idle.with_label_values(&l)
                .set(1.0 - spes_train::metrics::utilization(s.compute_s, s.idle_s));
            sync_s.with_label_values(&l).set(s.sync_s);
            up.with_label_values(&l).set(s.bytes_up as f64);
            down.with_label_values(&l).set(s.bytes_down as f64);
        }
        if let Some(a) = n.report_age_s {
            age.with_label_values(&l).set(a);
        }
    }
}

fn encode(reg: &Registry) -> String {
    let mut out = Vec::new();
    TextEncoder::new()
        .encode(&reg.gather(), &mut out)
        .expect("text encoding of gauges and counters");
    String::from_utf8(out).expect("the text format is UTF-8")
}

/// The content type of [`render`]'s text.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

#[cfg(test)]
mod tests {
    use super::*;
    use crate::view::{Counters, RunInfo};
    use spes_train::metrics::NodeReport;

    #[test]
    fn families_carry_their_labels_and_values() {
        let mut view = RunView {
            run: RunInfo {
                round: 7,
                lease_s: 20.0,
                val_loss: Some(5.25),
                ..Default::default()
            },
            counters: Counters::default(),
            ..Default::default()
        };
        view.counters.refusals.insert("closed".into(), 3);
        view.nodes.push(NodeView {
            peer: 2,
            member: true,
            lease_age_s: Some(1.5),
            uploads: 4,
            report: Some(NodeReport {
                step: 35,
                ..Default::default()
            }),
            ..Default::default()
        });
        let text = render(&view);
        for line in [
            "spes_round 7",
            "spes_val_loss 5.25",
            "spes_live_members 1",
            "spes_refusals_total{reason=\"closed\"} 3",
            "spes_node_lease_age_seconds{peer=\"2\"} 1.5",
            "spes_node_uploads_total{peer=\"2\"} 4",
            "spes_node_step{peer=\"2\"} 35",
            "# TYPE spes_node_uploads_total counter",
        ] {
            assert!(text.lines().any(|l| l == line), "no `{line}` in\n{text}");
        }
        assert!(!render_nodes(&view.nodes).contains("spes_round "));
    }
}
