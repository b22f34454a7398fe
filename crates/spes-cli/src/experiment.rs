//! `spes experiment --spec FILE`: runs named variants of one base config (centralized, SPES,
//! DiLoCo, any `--set` overrides) on the same data and token budget, for every seed, one after
//! another on loopback, then writes `results.md` and `results.json` (final and best validation
//! CE, their ratio to the baseline run, CE on held-out texts, tokens, wall time, optimizer
//! memory and traffic per node) and `val_ce.png` (validation CE against tokens, mean over
//! seeds). Finished runs are kept, so running it again resumes; the spec file alone
//! reproduces the results.

use crate::device::DeviceChoice;
use crate::{demo, report};
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use spes_data::{TokenizeOptions, TokenizerSource};
use spes_model::MoeModel;
use spes_train::metrics::{self, NodeSummary, RoundRecord, StepRecord};
use spes_train::{Mode, RunConfig};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// The experiment file (TOML). Paths are relative to the file's directory.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Spec {
    /// The base run config.
    config: PathBuf,
    /// Overrides of the base config shared by every run.
    #[serde(default)]
    set: Vec<String>,
    /// `train.seed` of each repetition.
    seeds: Vec<u64>,
    #[serde(default)]
    data: DataSpec,
    /// Texts no run trains on, scored with the final model of every run.
    #[serde(default)]
    eval_texts: Vec<PathBuf>,
    /// The run every other is compared with (default: the first).
    baseline: Option<String>,
    run: Vec<RunSpec>,
}

/// What every run trains on.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct DataSpec {
    /// Text, .jsonl or .jsonl.gz files (as `spes tokenize`); none: the demo's embedded corpus.
    #[serde(default)]
    inputs: Vec<PathBuf>,
    /// A Hugging Face tokenizer.json; else a BPE of `vocab` trained on the inputs.
    tokenizer: Option<PathBuf>,
    vocab: Option<usize>,
}

/// One variant: a name and its overrides (e.g. `sync.mode=centralized`).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RunSpec {
    name: String,
    #[serde(default)]
    set: Vec<String>,
    /// Some of the spec's seeds only (a cheaper screen of a variant); default: all.
    seeds: Option<Vec<u64>>,
}

/// What one run of one seed measured (`<run>/seed-<s>/result.json`).
#[derive(Debug, Serialize, Deserialize)]
struct RunResult {
    name: String,
    seed: u64,
    mode: Mode,
    tokens: u64,
    final_ce: f64,
    best_ce: f64,
    /// `(tokens, validation CE)` at every evaluation.
    curve: Vec<(f64, f64)>,
    /// CE (nats/token) of each of the spec's `eval_texts`, in order.
    held_out_ce: Vec<f64>,
    held_out_bpb: Vec<f64>,
    /// Seconds of the invocation that finished the run.
    wall_s: f64,
    /// AdamW moments per node (the whole model's for a centralized run).
    optimizer_bytes: u64,
    /// Bytes up plus down per node and round (0 for a centralized run).
    bytes_per_round: f64,
}

impl Spec {
    /// Reads and checks a spec: known keys, files that exist, runs that parse, and one token
    /// budget for every run.
    pub fn load(path: &Path) -> Result<Spec> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read experiment spec {}", path.display()))?;
        let mut spec: Spec =
            toml::from_str(&text).with_context(|| format!("experiment spec {}", path.display()))?;
        let dir = path.parent().unwrap_or(Path::new("."));
        let at = |p: &Path| dir.join(p);
        spec.config = at(&spec.config);
        spec.data.inputs = spec.data.inputs.iter().map(|p| at(p)).collect();
        spec.data.tokenizer = spec.data.tokenizer.as_deref().map(at);
        spec.eval_texts = spec.eval_texts.iter().map(|p| at(p)).collect();
        let files = std::iter::once(("config", &spec.config))
            .chain(spec.data.inputs.iter().map(|p| ("data.inputs", p)))
            .chain(spec.data.tokenizer.iter().map(|p| ("data.tokenizer", p)))
            .chain(spec.eval_texts.iter().map(|p| ("eval_texts", p)));
        for (key, p) in files {
            if !p.is_file() {
                bail!(
                    "{}: `{key}` names {}, which is not a file",
                    path.display(),
                    p.display()
                );
            }
        }
        if spec.seeds.is_empty() || spec.run.is_empty() {
            bail!(
                "{}: `seeds` and `[[run]]` must not be empty",
                path.display()
            );
        }
        for (i, r) in spec.run.iter().enumerate() {
            let ok = !r.name.is_empty()
                && r.name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c));
            if !ok || spec.run[..i].iter().any(|o| o.name == r.name) {
                bail!(
                    "{}: run name `{}` must be unique and made of letters, digits, -, _ and .",
                    path.display(),
                    r.name
                );
            }
        }
        let baseline = spec.baseline.clone().unwrap_or(spec.run[0].name.clone());
        for r in &spec.run {
            let seeds = r.seeds.as_deref().unwrap_or_default();
            if seeds.iter().any(|s| !spec.seeds.contains(s))
                || (r.name == baseline && r.seeds.is_some())
            {
                bail!(
                    "{}: run `{}`: `seeds` must be some of the spec's seeds, and the baseline \
                     runs them all",
                    path.display(),
                    r.name
                );
            }
        }
        if !spec.run.iter().any(|r| r.name == baseline) {
            bail!("{}: baseline `{baseline}` is not a run", path.display());
        }
        spec.baseline = Some(baseline);
        let configs = spec
            .run
            .iter()
            .map(|r| {
                spec.config_of(r, Path::new("data"), spec.seeds[0])
                    .with_context(|| format!("{}: run `{}`", path.display(), r.name))
            })
            .collect::<Result<Vec<_>>>()?;
        let budget = tokens_of(&configs[0]);
        for (r, c) in spec.run.iter().zip(&configs) {
            if tokens_of(c) != budget {
                bail!(
                    "{}: run `{}` trains on {} tokens, `{}` on {budget}: every run needs the same \
                     token budget (train.max_steps × batch × seq_len, × sync.nodes if decentralized)",
                    path.display(),
                    r.name,
                    tokens_of(c),
                    spec.run[0].name
                );
            }
        }
        Ok(spec)
    }

    fn config_of(&self, run: &RunSpec, data: &Path, seed: u64) -> Result<RunConfig> {
        let mut all = self.set.clone();
        all.extend(run.set.iter().cloned());
        all.push(format!("data.path={}", data.display()));
        all.push(format!("train.seed={seed}"));
        RunConfig::load(&self.config, &all)
    }

    fn seeds_of<'a>(&'a self, r: &'a RunSpec) -> &'a [u64] {
        r.seeds.as_deref().unwrap_or(&self.seeds)
    }

    fn baseline(&self) -> &str {
        self.baseline.as_deref().expect("set by load")
    }
}

/// Training tokens of a whole run.
fn tokens_of(cfg: &RunConfig) -> u64 {
    let nodes = match cfg.sync.mode {
        Mode::Centralized => 1,
        Mode::Spes | Mode::Diloco => cfg.sync.nodes as u64,
    };
    cfg.train.max_steps * cfg.tokens_per_step() * nodes
}

/// Run named variants of one config (centralized, SPES, DiLoCo, overrides) on the same data
/// and tokens for several seeds, one after another on loopback, and write a table and a
/// plot of their validation loss (experiments/tiny-ablation.toml). Resumes.
#[derive(clap::Args)]
pub struct Args {
    /// The experiment spec (TOML).
    #[arg(long)]
    pub spec: PathBuf,
    #[arg(long, default_value = "runs/experiment")]
    pub out: PathBuf,
    #[arg(long, value_enum, default_value_t = DeviceChoice::Auto)]
    pub device: DeviceChoice,
}

/// `spes experiment`.
pub fn command(a: Args) -> Result<()> {
    let device = crate::device::select(a.device)?;
    run(&a.spec, &a.out, device, &a.device.arg()).map_err(|e| {
        if e.is::<demo::Interrupted>() {
            anyhow::anyhow!(
                "{}. Run the same `spes experiment` command again to resume (finished runs are kept)",
                e.root_cause()
            )
        } else {
            e.context("experiment failed")
        }
    })
}

/// Runs every (seed, run) not finished yet under `out`, then writes the results.
fn run(spec_path: &Path, out: &Path, device: tch::Device, device_arg: &str) -> Result<()> {
    let spec = Spec::load(spec_path)?;
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    spes_data::shard::write_atomic(
        &out.join("spec.toml"),
        &std::fs::read(spec_path).context("cannot copy the spec")?,
    )?;
    let data = prepare_data(&spec.data, out)?;
    let total: usize = spec.run.iter().map(|r| spec.seeds_of(r).len()).sum();
    let mut done = 0;
    for &seed in &spec.seeds {
        for r in spec.run.iter().filter(|r| spec.seeds_of(r).contains(&seed)) {
            done += 1;
            let dir = out.join(&r.name).join(format!("seed-{seed}"));
            let result = dir.join("result.json");
            if result.exists() {
                continue;
            }
            let cfg = spec.config_of(r, &data, seed)?;
            println!("[{done}/{total}] {} seed {seed}: {}", r.name, dir.display());
            let started = Instant::now();
            train(&cfg, &dir, device, device_arg)
                .with_context(|| format!("run `{}` seed {seed} failed", r.name))?;
            let res = measure(&spec, r, seed, &cfg, &dir, started, device)?;
            println!(
                "    final validation CE {:.4} (best {:.4}) in {:.0} s",
                res.final_ce, res.best_ce, res.wall_s
            );
            spes_data::shard::write_atomic(
                &result,
                serde_json::to_string_pretty(&res)?.as_bytes(),
            )?;
        }
    }
    summarize(&spec, out)
}

/// Tokenizes the spec's inputs (or the embedded corpus) into `<out>/data` unless already there.
fn prepare_data(d: &DataSpec, out: &Path) -> Result<PathBuf> {
    if d.inputs.is_empty() {
        return demo::prepare_data(out);
    }
    let data = out.join("data");
    if !data.join(spes_data::shard::MANIFEST).exists() {
        let source = match (&d.tokenizer, d.vocab) {
            (Some(t), _) => TokenizerSource::File(t.clone()),
            (None, v) => TokenizerSource::Train(v.unwrap_or(8192)),
        };
        let inputs = d.inputs.iter().map(|p| p.display().to_string()).collect();
        let m = spes_data::tokenize(&TokenizeOptions::new(inputs, data.clone(), source))?.manifest;
        println!(
            "tokenized {} train / {} validation tokens, vocab {}",
            m.train_tokens, m.val_tokens, m.vocab_size
        );
    }
    Ok(data)
}

/// Trains one run to its end: in this process if centralized, else as a server and node
/// processes on loopback. Both resume what an interrupted invocation left.
fn train(cfg: &RunConfig, dir: &Path, device: tch::Device, device_arg: &str) -> Result<()> {
    if cfg.sync.mode == Mode::Centralized {
        let resume = dir.join("checkpoints").exists();
        spes_train::run(cfg.clone(), dir, device, resume, None, false, None)?;
    } else {
        demo::launch(
            dir,
            cfg,
            device_arg,
            None,
            false,
            None,
            &demo::Extras::default(),
        )?;
    }
    Ok(())
}

/// Reads a finished run's curve and costs and scores its final model on the held-out texts.
fn measure(
    spec: &Spec,
    r: &RunSpec,
    seed: u64,
    cfg: &RunConfig,
    dir: &Path,
    started: Instant,
    device: tch::Device,
) -> Result<RunResult> {
    let centralized = cfg.sync.mode == Mode::Centralized;
    let metrics = if centralized {
        dir.join("metrics.jsonl")
    } else {
        dir.join("server/metrics.jsonl")
    };
    let curve: Vec<(f64, f64)> = if centralized {
        metrics::read::<StepRecord>(&metrics)
            .iter()
            .filter_map(|r| Some((r.tokens as f64, r.val_loss?)))
            .collect()
    } else {
        metrics::read::<RoundRecord>(&metrics)
            .iter()
            .filter_map(|r| Some((r.tokens as f64, r.val_loss?)))
            .collect()
    };
    let Some(&(_, final_ce)) = curve.last() else {
        bail!("{} has no validation loss", metrics.display());
    };
    let best_ce = curve.iter().map(|p| p.1).fold(f64::INFINITY, f64::min);
    let model = MoeModel::new(&cfg.model, device)?;
    let weights = final_weights(cfg, dir)?;
    let named = tch::Tensor::read_safetensors(&weights)
        .with_context(|| format!("cannot read {}", weights.display()))?;
    let named: Vec<_> = named
        .into_iter()
        .map(|(n, t)| (n, t.to_device(device)))
        .collect();
    model.load(&named, &weights.display().to_string())?;
    let sc = crate::score::scoring(cfg, None, 16, device)?;
    let (mut held_out_ce, mut held_out_bpb) = (Vec::new(), Vec::new());
    for text in &spec.eval_texts {
        let body = std::fs::read_to_string(text)
            .with_context(|| format!("cannot read {}", text.display()))?;
        let s = spes_eval::score_text(&model, &sc, &body)?;
        held_out_ce.push(s.nll / s.predicted_tokens as f64);
        held_out_bpb.push(s.bits_per_byte);
    }
    let params: i64 = model.params().iter().map(|p| p.tensor.numel() as i64).sum();
    let (optimizer_bytes, bytes_per_round) = if centralized {
        (params as u64 * 8, 0.0)
    } else {
        let node: NodeSummary = serde_json::from_str(
            &std::fs::read_to_string(dir.join("node-0/summary.json"))
                .context("node 0 left no summary.json")?,
        )?;
        // The nodes' per-round records survive a resumed run; their summaries count only the
        // last process.
        let peers: Vec<u64> = (0..cfg.sync.nodes as u64).collect();
        let costs = report::round_costs(dir, &peers);
        let traffic: f64 = costs.iter().map(|c| c.bytes_up + c.bytes_down).sum();
        (
            node.optimizer_state_bytes,
            traffic / costs.len().max(1) as f64,
        )
    };
    Ok(RunResult {
        name: r.name.clone(),
        seed,
        mode: cfg.sync.mode,
        tokens: tokens_of(cfg),
        final_ce,
        best_ce,
        curve,
        held_out_ce,
        held_out_bpb,
        wall_s: started.elapsed().as_secs_f64(),
        optimizer_bytes,
        bytes_per_round,
    })
}

/// The final model of a finished run: the newest centralized checkpoint, or the server's
/// checkpoint of the last round.
fn final_weights(cfg: &RunConfig, dir: &Path) -> Result<PathBuf> {
    if cfg.sync.mode == Mode::Centralized {
        let ck = spes_train::checkpoint::latest(&dir.join("checkpoints"))?
            .with_context(|| format!("{} holds no checkpoint", dir.display()))?;
        return Ok(ck.join(spes_train::checkpoint::MODEL_FILE));
    }
    let round = cfg.train.max_steps / cfg.sync.sync_steps;
    Ok(dir
        .join("server/checkpoints")
        .join(format!("round-{round:06}.safetensors")))
}

/// Mean and half the spread (max − min) / 2 of some values.
fn mean_spread(v: &[f64]) -> (f64, f64) {
    let mean = v.iter().sum::<f64>() / v.len() as f64;
    let (lo, hi) = v
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), x| {
            (a.min(*x), b.max(*x))
        });
    (mean, (hi - lo) / 2.0)
}

/// Writes `results.json`, `results.md` and `val_ce.png` from every finished run under `out`.
fn summarize(spec: &Spec, out: &Path) -> Result<()> {
    let mut results: Vec<Vec<RunResult>> = Vec::new();
    for r in &spec.run {
        let mut per_seed = Vec::new();
        for seed in spec.seeds_of(r) {
            let path = out.join(&r.name).join(format!("seed-{seed}/result.json"));
            let text = std::fs::read_to_string(&path)
                .with_context(|| format!("cannot read {}", path.display()))?;
            per_seed.push(serde_json::from_str(&text)?);
        }
        results.push(per_seed);
    }
    let base = spec
        .run
        .iter()
        .position(|r| r.name == spec.baseline())
        .expect("checked by load");
    let pm = |(m, s): (f64, f64), n: usize| {
        if n > 1 {
            format!("{m:.4} ± {s:.4}")
        } else {
            format!("{m:.4}")
        }
    };
    // Each seed's value over the baseline's of the same seed.
    let ratios = |rs: &[RunResult], f: &dyn Fn(&RunResult) -> f64| -> Vec<f64> {
        rs.iter()
            .map(|a| {
                let b = results[base].iter().find(|b| b.seed == a.seed);
                f(a) / f(b.expect("the baseline runs every seed"))
            })
            .collect()
    };
    let texts: Vec<String> = spec
        .eval_texts
        .iter()
        .map(|p| {
            p.file_name()
                .unwrap_or_default()
                .to_string_lossy()
                .into_owned()
        })
        .collect();
    let mut md = format!(
        "Validation cross-entropy (nats/token), mean ± half the spread over seeds {:?} (or \
         those a run lists); ratios are to `{}` of the same seed, then averaged.\n\n",
        spec.seeds,
        spec.baseline()
    );
    md += "| run | seeds | final val CE | ratio | best val CE |";
    for t in &texts {
        md += &format!(" {t} CE | ratio |");
    }
    md += " tokens | wall s | optimizer MiB / node | MiB / node round |\n|---|---|---|---|---|";
    md += &"---|---|".repeat(texts.len());
    md += "---|---|---|---|\n";
    let mut json_rows = Vec::new();
    for (r, rs) in spec.run.iter().zip(&results) {
        let col = |f: &dyn Fn(&RunResult) -> f64| rs.iter().map(f).collect::<Vec<f64>>();
        let final_ce = mean_spread(&col(&|x| x.final_ce));
        let ratio = mean_spread(&ratios(rs, &|x| x.final_ce));
        let n = rs.len();
        md += &format!(
            "| {} | {n} | {} | {} | {} |",
            r.name,
            pm(final_ce, n),
            pm(ratio, n),
            pm(mean_spread(&col(&|x| x.best_ce)), n)
        );
        let mut held = Vec::new();
        for (i, text) in texts.iter().enumerate() {
            let ce = mean_spread(&col(&|x| x.held_out_ce[i]));
            let ratio = mean_spread(&ratios(rs, &|x| x.held_out_ce[i]));
            md += &format!(" {} | {} |", pm(ce, n), pm(ratio, n));
            held.push(serde_json::json!({"text": text, "ce": ce.0, "ratio": ratio.0}));
        }
        let wall = mean_spread(&col(&|x| x.wall_s)).0;
        let opt = rs[0].optimizer_bytes as f64 / (1 << 20) as f64;
        let traffic = rs[0].bytes_per_round / (1 << 20) as f64;
        md += &format!(
            " {} | {wall:.0} | {opt:.1} | {traffic:.1} |\n",
            rs[0].tokens
        );
        json_rows.push(serde_json::json!({
            "run": r.name, "seeds": spec.seeds_of(r), "final_ce": final_ce.0, "final_ce_spread": final_ce.1,
            "ratio": ratio.0, "ratio_spread": ratio.1, "held_out": held,
            "tokens": rs[0].tokens, "wall_s": wall, "optimizer_bytes": rs[0].optimizer_bytes,
            "bytes_per_round": rs[0].bytes_per_round,
        }));
    }
    // From a tenth of the budget on: the first evaluations would flatten the differences.
    let from = results[base][0].tokens as f64 / 10.0;
    let series: Vec<(String, Vec<(f64, f64)>)> = spec
        .run
        .iter()
        .zip(&results)
        .map(|(r, rs)| {
            let curve = mean_curve(rs).into_iter().filter(|p| p.0 >= from);
            (r.name.clone(), curve.collect())
        })
        .collect();
    report::loss_plot(
        &out.join("val_ce.png"),
        "validation CE (mean over seeds), from 10 % of the tokens",
        &series,
    )?;
    md += "\n![validation CE against tokens](val_ce.png)\n";
    spes_data::shard::write_atomic(&out.join("results.md"), md.as_bytes())?;
    spes_data::shard::write_atomic(
        &out.join("results.json"),
        serde_json::to_string_pretty(&json_rows)?.as_bytes(),
    )?;
    print!("{md}");
    println!("results: {}", out.join("results.md").display());
    Ok(())
}

/// The seeds' curves averaged at the token counts all of them evaluated.
fn mean_curve(rs: &[RunResult]) -> Vec<(f64, f64)> {
    rs[0]
        .curve
        .iter()
        .filter_map(|&(t, _)| {
            let ys: Vec<f64> = rs
                .iter()
                .map(|r| r.curve.iter().find(|p| p.0 == t).map(|p| p.1))
                .collect::<Option<_>>()?;
            Some((t, ys.iter().sum::<f64>() / ys.len() as f64))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every shipped spec loads (runs that parse, one token budget), and its centralized
    /// baseline trains at the rate it was measured with, not at whatever a SPES config holds.
    #[test]
    fn shipped_specs_load_and_pin_the_centralized_rate() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../experiments");
        let mut checked = 0;
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let spec = Spec::load(&path).unwrap_or_else(|e| panic!("{}: {e:#}", path.display()));
            for r in &spec.run {
                let cfg = spec.config_of(r, Path::new("data"), spec.seeds[0]).unwrap();
                if cfg.sync.mode == Mode::Centralized {
                    assert_eq!(cfg.train.lr, 3e-3, "{}: {}", path.display(), r.name);
                    assert_eq!(cfg.train.expert_lr_scale, 1.0, "{}", path.display());
                }
            }
            checked += 1;
        }
        assert!(checked >= 4, "only {checked} specs in {}", dir.display());
    }
}
