//! The round closer and the scorer, each on its own thread. The closer closes a round when
//! every live member uploaded or it timed out, publishes it durably (retrying until it works),
//! announces it, and hands it to the scorer, which adds the global model's validation loss and
//! expert load to the round's record and writes it to `metrics.jsonl`.

use super::store::Publication;
use super::State;
use crate::choose::{Chooser, Prediction};
use crate::settings::Choices;
use anyhow::Result;
use spes_data::ValWindows;
use spes_model::MoeModel;
use spes_sync::wire_cost::WireCosts;
use spes_sync::{Named, RoundBy, RoundDelta, RoundReport, Scope};
use spes_sync::{RoundSettings, Wire};
use spes_train::metrics::{
    Candidate, MergeRecord, MetricsLog, RoundClose, RoundRecord, SettingsChoice,
};
use spes_train::RunConfig;
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};
use tch::Device;

/// Scores published models: validation loss, expert load, and tasks when due.
pub(super) struct Evaluator {
    pub model: MoeModel,
    pub val: ValWindows,
    pub batch: usize,
    pub max_batches: usize,
    pub device: Device,
    pub tasks: Option<spes_train::task_hook::TaskHook>,
}

impl Evaluator {
    /// Adds `val_loss`, `expert_load` and `tasks` to a round's record.
    fn score(&self, global: &Named, step: u64, record: &mut RoundRecord) -> Result<()> {
        self.model.load(global, "published model")?;
        let (val_loss, expert_load) = spes_train::validation_stats(
            &self.model,
            &self.val,
            self.batch,
            self.max_batches,
            self.device,
        );
        record.val_loss = Some(val_loss);
        record.expert_load = Some(expert_load);
        if let Some(t) = self.tasks.as_ref().filter(|t| t.due(step)) {
            record.tasks = Some(t.score(&self.model)?);
        }
        Ok(())
    }
}

/// A published round waiting to be scored and logged.
pub(super) struct ScoreJob {
    pub step: u64,
    pub global: Named,
    pub record: RoundRecord,
}

/// Traffic and events since the last round line.
#[derive(Default)]
pub(super) struct RoundIo {
    pub bytes_in: u64,
    pub bytes_out: u64,
    /// Fetches answered with a presigned URL; fetches served because the store failed a node;
    /// uploads read from the store, where their nodes staged them.
    pub links: u64,
    pub fallbacks: u64,
    pub staged: u64,
    /// The round's uploads as they were received and folded.
    pub uploads: Vec<spes_train::metrics::UploadTiming>,
    pub rejected: Vec<String>,
    /// Nodes that said they finished (kept across rounds).
    pub done: BTreeSet<usize>,
}

/// The metrics line of a closed round, before scoring.
fn round_record(
    r: &RoundReport,
    tokens: u64,
    io: RoundIo,
    aggregation_s: f64,
    round_s: f64,
) -> RoundRecord {
    RoundRecord {
        round: r.round,
        step: r.step,
        tokens,
        members: r.members.clone(),
        owners: r.owners.clone(),
        close: Some(RoundClose {
            peers: r.peers.clone(),
            missing: r.missing.clone(),
            evicted: r.evicted.clone(),
            joined: r.joined.clone(),
            discarded: r.discarded.clone(),
            bytes_in: io.bytes_in,
            bytes_out: io.bytes_out,
            store_bytes_out: 0,
            store_links: io.links,
            store_fallbacks: io.fallbacks,
            store_staged: io.staged,
            aggregation_s,
            publish_s: 0.0,
            round_s,
            merge_alpha: r.merge_alpha,
            merges: r
                .merges
                .iter()
                .map(|m| MergeRecord {
                    layer: m.layer,
                    expert: m.expert,
                    neighbours: m.neighbours.clone(),
                })
                .collect(),
            rejected: io.rejected,
            outer_scale: r.outer_scale,
            bytes_written: 0,
            nodes: Default::default(),
            work: r.work.clone(),
            budget: r.budget.clone(),
            uploads: {
                let mut u = io.uploads;
                u.sort_by_key(|t| t.peer);
                u
            },
            planned: None,
            settings: None,
            choice: None,
        }),
        ..RoundRecord::default()
    }
}

/// Training tokens a closed round added: its uploads' `sync_steps` steps of the run's batch,
/// or, by tokens, the rows each upload reports it trained.
fn round_tokens(cfg: &RunConfig, r: &RoundReport) -> u64 {
    let nominal = cfg.rows_per_round();
    let rows: u64 = match cfg.sync.round_by {
        RoundBy::Steps => r.peers.len() as u64 * nominal,
        RoundBy::Tokens => r
            .peers
            .iter()
            .map(|p| match r.work.iter().find(|w| w.peer == *p) {
                Some(w) if w.work.rows > 0 => w.work.rows,
                _ => nominal,
            })
            .sum(),
    };
    rows * cfg.train.seq_len as u64
}

/// The round closer: closes ready rounds, publishes them (retrying until it works), announces
/// them and hands them to the scorer; says every minute when no node is alive; signals `done`
/// once the last round is out and every member said it finished (or `linger_s` passed).
pub(super) fn run_closer(
    s: Arc<State>,
    wake: mpsc::Receiver<()>,
    scorer: mpsc::Sender<ScoreJob>,
    stop: Arc<AtomicBool>,
    done: tokio::sync::oneshot::Sender<()>,
    linger_s: f64,
) {
    let mut final_at: Option<f64> = None;
    let mut last_alone_warning = f64::NEG_INFINITY;
    let mut book = Books {
        opened_at: s.now(),
        written_before: spes_train::process::bytes_written(),
        put_before: s.store.bytes_put(),
        last_full: Instant::now(),
        measured: Default::default(),
        lived: Default::default(),
        wire_costs: None,
        wires_timed: false,
    };
    while !stop.load(Ordering::Relaxed) {
        let _ = wake.recv_timeout(Duration::from_millis(100));
        let now = s.now();
        if let Some(closed) = close_if_ready(&s, now, &mut last_alone_warning) {
            let Some(job) = publish(&s, closed, now, &mut book, &stop) else {
                return;
            };
            let _ = scorer.send(job);
        }
        if *s.published.borrow() >= s.final_round {
            let now = s.now();
            let at = *final_at.get_or_insert(now);
            let members = s.coord.lock().unwrap().scope().members();
            let all = members.is_subset(&s.io.lock().unwrap().done);
            if all || now - at >= linger_s {
                let _ = done.send(());
                return;
            }
        }
    }
}

/// What the closer keeps between rounds: when the open round opened, the bytes this process
/// had written when the last round was published, and when the last whole model was.
struct Books {
    opened_at: f64,
    written_before: u64,
    /// The bytes this process had put in the store by then.
    put_before: u64,
    last_full: Instant,
    /// The links and speeds the rounds measured.
    measured: crate::measure::Measured,
    /// What each setting the run ran predicted and lived.
    lived: crate::lived::Lived,
    /// An adaptive run's candidate wires' code, timed on the model at its first close.
    wire_costs: Option<WireCosts>,
    wires_timed: bool,
}

/// A round the coordinator closed, with what publishing it needs.
struct Closed {
    report: RoundReport,
    /// The closed round's own settings.
    settings: RoundSettings,
    global: Named,
    delta: Option<RoundDelta>,
    carried: Named,
    next: Scope,
    gone: BTreeSet<usize>,
    aggregation_s: f64,
}

/// Closes the open round if it is ready at `now`, under the coordinator's lock (memory work
/// only); warns at most once a minute while no node is alive.
fn close_if_ready(s: &State, now: f64, last_alone_warning: &mut f64) -> Option<Closed> {
    let mut coord = s.coord.lock().unwrap();
    if coord.live_members(now).is_empty() && now - *last_alone_warning >= 60.0 {
        *last_alone_warning = now;
        tracing::warn!(
            "no node is alive: round {} stays open, state kept; waiting for nodes to (re)join",
            coord.round()
        );
    }
    if !coord.ready(now) {
        return None;
    }
    let stalled = coord.stalled(now);
    if !stalled.is_empty() {
        tracing::warn!(
            "round {} closes without node(s) {stalled:?}: live, but no step trained and no byte moved for {:.0} s (sync.stall_s); they train a later round",
            coord.round(),
            coord.cfg().stall_after_s()
        );
    }
    let t0 = Instant::now();
    let settings = coord.cfg().settings();
    let report = coord.close(now);
    let global = shallow(coord.global().0);
    let delta = coord.delta().map(|d| RoundDelta {
        delta: shallow(&d.delta),
        verbatim: d.verbatim.clone(),
    });
    Some(Closed {
        report,
        settings,
        global,
        delta,
        carried: coord.carried(),
        next: coord.scope().clone(),
        gone: coord.gone().clone(),
        aggregation_s: t0.elapsed().as_secs_f64(),
    })
}

/// Publishes a closed round durably (retrying until it works; `None` if stopped meanwhile),
/// announces it and returns it for the scorer.
fn publish(
    s: &State,
    c: Closed,
    now: f64,
    book: &mut Books,
    stop: &AtomicBool,
) -> Option<ScoreJob> {
    let report = &c.report;
    let tokens = s.progress.read().0.newest().tokens + round_tokens(&s.cfg, report);
    let io = {
        let mut io = s.io.lock().unwrap();
        let done = io.done.clone();
        let taken = std::mem::take(&mut *io);
        io.done = done;
        taken
    };
    let mut record = round_record(report, tokens, io, c.aggregation_s, now - book.opened_at);
    if let Some(close) = &mut record.close {
        let took_part: Vec<usize> = report
            .peers
            .iter()
            .chain(&report.missing)
            .copied()
            .collect();
        close.nodes = s.watch.lock().unwrap().node_rounds(&took_part);
    }
    record.data_parts = s.progress.read().0.data_parts.of_members(&report.members);
    let full = s.full_round(report.round, book.last_full.elapsed().as_secs_f64());
    // Nodes fetch a delta round's delta: its whole model, a restart point, is written after
    // the round is announced, while they train on.
    let full_after = full && c.delta.is_some();
    let publication = Publication {
        round: report.round,
        global: &c.global,
        next: &c.next,
        budget: &report.budget,
        settings: report.settings,
        tokens,
        gone: &c.gone,
        record: record.clone(),
        delta: c.delta.as_ref(),
        carried: c.carried,
        full: full && !full_after,
    };
    let publishing = Instant::now();
    let published = until_written(stop, &format!("publishing round {}", report.round), || {
        s.store.publish(&s.progress, &publication)
    });
    if !published {
        return None;
    }
    let publish_s = publishing.elapsed().as_secs_f64();
    s.watch.lock().unwrap().counters.publish_s = publish_s;
    s.published.send_replace(report.round);
    // The next round opens with the announcement.
    book.opened_at = s.now();
    if full_after {
        let t = Instant::now();
        let what = format!("writing round {}'s whole model", report.round);
        let written = until_written(stop, &what, || {
            let carried = &publication.carried;
            s.store
                .publish_full(&s.progress, report.round, &c.global, carried)
        });
        if !written {
            return None;
        }
        tracing::debug!(
            "round {}: whole model written in {:.2} s after the round was announced",
            report.round,
            t.elapsed().as_secs_f64()
        );
    }
    if full {
        book.last_full = Instant::now();
    }
    if let Some(close) = &mut record.close {
        let written = spes_train::process::bytes_written();
        close.bytes_written = written.saturating_sub(book.written_before);
        book.written_before = written;
        let put = s.store.bytes_put();
        close.store_bytes_out = put.saturating_sub(book.put_before);
        book.put_before = put;
        close.publish_s = publish_s;
        close.settings = Some(c.settings);
        book.measured.observe(close);
        book.lived
            .closed(report.round, c.settings, close.round_s, &report.peers);
        book.lived.observe(&close.nodes);
        // The planner scales every option by what the closed round's own setting measured.
        let round_cfg = RunConfig {
            sync: s.cfg.sync.for_round(c.settings),
            ..s.cfg.clone()
        };
        if !book.wires_timed {
            book.wire_costs = time_candidate_wires(s);
            book.wires_timed = true;
        }
        close.planned = crate::measure::planned(
            &round_cfg,
            &book.measured,
            &report.members,
            book.wire_costs.as_ref(),
        );
        close.choice = settle_next(s, report.round, &round_cfg, book, &report.members);
        if let Some(p) = &close.planned {
            let options: Vec<String> = p
                .options
                .iter()
                .map(|o| format!("{} {:.1} %", o.wire, 100.0 * o.utilization))
                .collect();
            tracing::debug!(
                "round {}: on the slowest member's link ({:.1} Mbit/s up, {:.1} down, {:.2} s latency, {:.3} s a step) the planner predicts {}",
                report.round,
                p.up_mbit_s,
                p.down_mbit_s,
                p.latency_s,
                p.step_s,
                options.join(", ")
            );
        }
    }
    let list = |what: &str, peers: &[usize]| {
        if peers.is_empty() {
            String::new()
        } else {
            format!(", {what} {peers:?}")
        }
    };
    tracing::info!(
        "round {} published: peers {:?}{}{}{}",
        report.round,
        report.peers,
        report
            .merge_alpha
            .map(|a| format!(", merged {} experts with α {a:.4}", report.merges.len()))
            .unwrap_or_default(),
        list("evicted", &report.evicted),
        list("admitted", &report.joined),
    );
    Some(ScoreJob {
        step: report.step,
        global: c.global,
        record,
    })
}

/// Runs `write` until it works, waiting longer after each failure: false if the server was
/// stopped meanwhile.
fn until_written(stop: &AtomicBool, what: &str, mut write: impl FnMut() -> Result<()>) -> bool {
    let mut pause = Duration::from_millis(500);
    while let Err(e) = write() {
        super::mirror::exit_if_fenced(&e);
        tracing::error!(
            "{what} failed, retrying in {:.1} s: {e:#}",
            pause.as_secs_f64()
        );
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_secs(30));
        if stop.load(Ordering::Relaxed) {
            return false;
        }
    }
    true
}

/// An adaptive run's candidate wires' code timed on its model, so that what the running wire
/// measured carries over to the others (`measure::input_for`); `None` in a run that does not
/// choose.
fn time_candidate_wires(s: &State) -> Option<WireCosts> {
    let mut wires: Vec<Wire> = match &*s.settle.lock().unwrap() {
        Settle::Adaptive { chooser, .. } => chooser.candidates().iter().map(|c| c.wire).collect(),
        _ => return None,
    };
    wires.sort();
    wires.dedup();
    let t = Instant::now();
    let costs = spes_sync::wire_cost::time_model(&s.cfg.model, &s.cfg.sync, &wires);
    let each: Vec<String> = costs
        .iter()
        .map(|(w, c)| {
            format!(
                "{} encode {:.3} s, fold {:.3} s, apply {:.3} s",
                w.name(),
                c.encode_s,
                c.fold_s,
                c.apply_s
            )
        })
        .collect();
    tracing::info!(
        "timed each candidate wire's code on the whole model in {:.1} s: {}",
        t.elapsed().as_secs_f64(),
        each.join("; ")
    );
    Some(costs)
}

/// How the rounds' settings are decided after each round.
pub(super) enum Settle {
    /// Both keys pinned: the config's, every round.
    Pinned,
    /// `--replay-choices`: as the recorded run took them.
    Replay(Choices),
    /// Chosen on what the run measures; what it took is kept in `<out>/choices.json`.
    Adaptive { chooser: Chooser, choices: Choices },
}

/// After round `round` is published: sets the settings the next close announces (those of
/// round `round + 2`) as the run decides them, and returns an adaptive run's look at its
/// candidates for the round's record.
fn settle_next(
    s: &State,
    round: u64,
    round_cfg: &RunConfig,
    book: &mut Books,
    members: &[usize],
) -> Option<SettingsChoice> {
    let mut settle = s.settle.lock().unwrap();
    let (next, choice, chosen) = match &mut *settle {
        Settle::Pinned => return None,
        Settle::Replay(choices) => (choices.at(round + 2, &s.cfg.sync), None, None),
        Settle::Adaptive { chooser, choices } => {
            let planned = crate::measure::predict_settings(
                round_cfg,
                &book.measured,
                members,
                &chooser.candidates(),
                book.wire_costs.as_ref(),
            )?;
            // The running candidate's prediction is what it lived over its last rounds; each
            // other's is corrected by what it lived when it last ran.
            let running = round_cfg.sync.settings();
            let mut corrections = Vec::new();
            let predicted: Vec<Prediction> = planned
                .iter()
                .map(|&p| {
                    let (settings, u) = (p.settings, p.utilization);
                    let Some(lived) = book.lived.predicted(settings, u, settings == running) else {
                        return p;
                    };
                    corrections.push(format!(
                        "{settings} {:.1} % planned, {:+.1} points lived{}",
                        100.0 * u,
                        100.0 * (lived - u),
                        if settings == running {
                            " (running)"
                        } else {
                            ""
                        }
                    ));
                    Prediction {
                        utilization: lived.clamp(0.0, 1.0),
                        ..p
                    }
                })
                .collect();
            let decision = chooser.choose(round, &predicted).map(|mut d| {
                if !corrections.is_empty() {
                    d.reason +=
                        &format!("; corrected by what they lived: {}", corrections.join(", "));
                }
                // Its rounds are held to the planner's own prediction.
                if let Some(p) = planned.iter().find(|p| p.settings == d.settings) {
                    book.lived.chosen(p.settings, p.utilization);
                }
                d
            });
            let candidates = predicted
                .iter()
                .map(|p| Candidate {
                    settings: p.settings,
                    utilization: p.utilization,
                    loss_ratio: chooser.loss_ratio(p.settings).unwrap_or(f64::NAN),
                })
                .collect();
            let Some(d) = decision else {
                return Some(SettingsChoice {
                    candidates,
                    ..SettingsChoice::default()
                });
            };
            tracing::info!(
                "from round {} the run takes {}: {}",
                d.from_round,
                d.settings,
                d.reason
            );
            choices.push(d.clone());
            let choice = SettingsChoice {
                candidates,
                chose: Some(d.clone()),
            };
            (d.settings, Some(choice), Some(choices.clone()))
        }
    };
    drop(settle);
    // Kept with the restart point (and its store), and as the file a rerun replays.
    if let Some(choices) = chosen {
        let kept = choices.clone();
        let (_, version) = s.progress.change(move |st| {
            st.choices = kept;
            ((), true)
        });
        let saved = version
            .map_or(Ok(()), |v| s.progress.commit(v))
            .and_then(|()| choices.save(&s.store.out));
        if let Err(e) = saved {
            super::mirror::exit_if_fenced(&e);
            tracing::error!("cannot record the run's choices: {e:#}");
        }
    }
    if let Err(e) = s.coord.lock().unwrap().set_next(next) {
        tracing::error!("round {}: {e}", round + 2);
    }
    choice
}

/// Scores and logs published rounds in order, on its own thread.
pub(super) fn run_scorer(
    s: Arc<State>,
    eval: Option<Evaluator>,
    jobs: mpsc::Receiver<ScoreJob>,
    mut metrics: MetricsLog,
) {
    for mut job in jobs {
        if let Some(e) = &eval {
            if let Err(err) = e.score(&job.global, job.step, &mut job.record) {
                tracing::error!("scoring round {} failed: {err:#}", job.record.round);
            }
        }
        if let Some(v) = job.record.val_loss {
            s.watch.lock().unwrap().val_loss = Some(v);
            if job.record.round == 0 {
                // Written with the next round's restart point.
                s.progress.change(|st| {
                    st.initial_val_loss = Some(v);
                    ((), true)
                });
            }
        }
        if let Err(e) = metrics.write(&job.record) {
            tracing::error!("cannot write metrics.jsonl: {e:#}");
        }
        let mut watch = s.watch.lock().unwrap();
        if let Some(c) = &job.record.close {
            watch.counters.joins += c.joined.len() as u64;
            watch.counters.evictions += c.evicted.len() as u64;
        }
        watch.history.push(&job.record, true);
    }
}

pub(super) fn shallow(named: &Named) -> Named {
    named
        .iter()
        .map(|(n, t)| (n.clone(), t.shallow_clone()))
        .collect()
}
