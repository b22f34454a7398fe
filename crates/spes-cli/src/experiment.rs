//! `spes experiment --spec FILE`: runs named variants of one base config (centralized, SPES,
//! DiLoCo, any `--set` overrides) on the same data and token budget, for every seed, one after
//! another on loopback, then writes `results.md` and `results.json` (final and best validation
//! CE, their ratio to the baseline run, CE on held-out texts, tokens, wall time, optimizer
//! memory and traffic per node) and `val_ce.png` (validation CE against tokens, mean over
//! seeds). A spec may also list recipes (`[[recipe]]`: sequence length, steps, batch, nodes,
//! corpus): every run then runs on every recipe against that recipe's baseline, and a grid
//! table gives each run's ratio per recipe. Finished runs are kept, so running it again
//! resumes; the spec file alone reproduces the results.

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
    /// Recipes every run runs on (none: the base config alone).
    #[serde(default)]
    recipe: Vec<Recipe>,
}

/// One recipe of a grid: overrides of the base config (sequence length, steps, batch, nodes)
/// and optionally a corpus and held-out texts of its own.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Recipe {
    name: String,
    /// What differs from the grid's centre, in words (the grid table's second column).
    #[serde(default)]
    about: String,
    #[serde(default)]
    set: Vec<String>,
    /// Overrides for the baseline run on this recipe only, after the run's own (for example a
    /// centralized baseline's batch: nodes × the nodes' batch).
    #[serde(default)]
    baseline_set: Vec<String>,
    /// A corpus of its own (default: the spec's `[data]`).
    data: Option<DataSpec>,
    /// Held-out texts of its own (default: the spec's `eval_texts`).
    eval_texts: Option<Vec<PathBuf>>,
    /// Some of the spec's seeds only; default: all.
    seeds: Option<Vec<u64>>,
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
    /// Share of documents held out for validation (default 0.02, as `spes tokenize`).
    val_fraction: Option<f64>,
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
    /// Some of the spec's recipes only (a variant screened where it should matter); default:
    /// all.
    recipes: Option<Vec<String>>,
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
    /// CE of the final model on every window of the corpus's validation split, scored here,
    /// so every run of a recipe is scored on the same windows whatever its batch (the
    /// training-time evaluations read `eval_batches × batch_size` windows).
    #[serde(default)]
    val_ce: Option<f64>,
    /// Seconds of the invocation that finished the run.
    wall_s: f64,
    /// AdamW moments per node (the whole model's for a centralized run).
    optimizer_bytes: u64,
    /// Bytes up plus down per node and round (0 for a centralized run).
    bytes_per_round: f64,
}

impl Spec {
    /// Reads and checks a spec: known keys, files that exist, runs that parse, and one token
    /// budget for every run of a recipe.
    pub fn load(path: &Path) -> Result<Spec> {
        Self::read(path, true)
    }

    /// [`Spec::load`], requiring its data and text files to exist only with `need_files` (the
    /// shipped specs name `../shared/`, which a plain clone lacks; their config must exist).
    fn read(path: &Path, need_files: bool) -> Result<Spec> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read experiment spec {}", path.display()))?;
        let mut spec: Spec =
            toml::from_str(&text).with_context(|| format!("experiment spec {}", path.display()))?;
        let dir = path.parent().unwrap_or(Path::new("."));
        let at = |p: &Path| dir.join(p);
        let data_at = |d: &mut DataSpec| {
            d.inputs = d.inputs.iter().map(|p| at(p)).collect();
            d.tokenizer = d.tokenizer.as_deref().map(at);
        };
        spec.config = at(&spec.config);
        data_at(&mut spec.data);
        spec.eval_texts = spec.eval_texts.iter().map(|p| at(p)).collect();
        for r in &mut spec.recipe {
            if let Some(d) = &mut r.data {
                data_at(d);
            }
            if let Some(t) = &mut r.eval_texts {
                *t = t.iter().map(|p| at(p)).collect();
            }
        }
        let datas =
            std::iter::once(&spec.data).chain(spec.recipe.iter().filter_map(|r| r.data.as_ref()));
        let mut files = vec![("config", &spec.config)];
        for d in datas {
            files.extend(d.inputs.iter().map(|p| ("data.inputs", p)));
            files.extend(d.tokenizer.iter().map(|p| ("data.tokenizer", p)));
            if let Some(f) = d.val_fraction {
                if !(f > 0.0 && f < 1.0) {
                    bail!(
                        "{}: `data.val_fraction` must be in (0, 1), got {f}",
                        path.display()
                    );
                }
            }
        }
        let texts = std::iter::once(&spec.eval_texts)
            .chain(spec.recipe.iter().filter_map(|r| r.eval_texts.as_ref()));
        for t in texts {
            files.extend(t.iter().map(|p| ("eval_texts", p)));
        }
        for (key, p) in files {
            if (need_files || key == "config") && !p.is_file() {
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
        let named = |n: &str| {
            !n.is_empty()
                && n != "data"
                && n.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        };
        for (i, r) in spec.run.iter().enumerate() {
            if !named(&r.name) || spec.run[..i].iter().any(|o| o.name == r.name) {
                bail!(
                    "{}: run name `{}` must be unique and made of letters, digits, -, _ and .",
                    path.display(),
                    r.name
                );
            }
        }
        for (i, r) in spec.recipe.iter().enumerate() {
            let clash = spec.recipe[..i].iter().any(|o| o.name == r.name)
                || spec.run.iter().any(|o| o.name == r.name);
            if !named(&r.name) || clash {
                bail!(
                    "{}: recipe name `{}` must be unique, not a run's, and made of letters, \
                     digits, -, _ and .",
                    path.display(),
                    r.name
                );
            }
            let seeds = r.seeds.as_deref().unwrap_or_default();
            if seeds.iter().any(|s| !spec.seeds.contains(s)) {
                bail!(
                    "{}: recipe `{}`: `seeds` must be some of the spec's seeds",
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
        for r in &spec.run {
            let names = r.recipes.as_deref().unwrap_or_default();
            if let Some(bad) = names
                .iter()
                .find(|n| !spec.recipe.iter().any(|c| c.name == **n))
            {
                bail!(
                    "{}: run `{}`: recipe `{bad}` is not a [[recipe]]",
                    path.display(),
                    r.name
                );
            }
            if r.name == baseline && r.recipes.is_some() {
                bail!(
                    "{}: the baseline `{baseline}` runs on every recipe",
                    path.display()
                );
            }
        }
        if !spec.run.iter().any(|r| r.name == baseline) {
            bail!("{}: baseline `{baseline}` is not a run", path.display());
        }
        spec.baseline = Some(baseline);
        if spec.recipe.is_empty() {
            spec.recipe.push(Recipe {
                name: String::new(),
                about: String::new(),
                set: Vec::new(),
                baseline_set: Vec::new(),
                data: None,
                eval_texts: None,
                seeds: None,
            });
        }
        for recipe in &spec.recipe {
            // Only the runs of this recipe: a run screened on one recipe may change what ties
            // its budget to another's (steps, accumulation).
            let runs: Vec<&RunSpec> = spec
                .run
                .iter()
                .filter(|r| spec.runs_on(recipe, r))
                .collect();
            let within = |r: &&RunSpec| {
                let c = spec.config_of(recipe, r, Path::new("data"), spec.seeds[0]);
                c.with_context(|| format!("{}: {}", path.display(), spec.label(recipe, r)))
            };
            let configs = runs.iter().map(within).collect::<Result<Vec<_>>>()?;
            let budget = tokens_of(&configs[0]);
            for (r, c) in runs.iter().zip(&configs) {
                if tokens_of(c) != budget {
                    bail!(
                        "{}: {} trains on {} tokens, `{}` on {budget}: every run of a recipe \
                         needs the same token budget (train.max_steps × batch × seq_len, × \
                         sync.nodes if decentralized)",
                        path.display(),
                        spec.label(recipe, r),
                        tokens_of(c),
                        runs[0].name
                    );
                }
            }
        }
        Ok(spec)
    }

    fn config_of(
        &self,
        recipe: &Recipe,
        run: &RunSpec,
        data: &Path,
        seed: u64,
    ) -> Result<RunConfig> {
        let mut all = self.set.clone();
        all.extend(recipe.set.iter().cloned());
        all.extend(run.set.iter().cloned());
        if run.name == self.baseline() {
            all.extend(recipe.baseline_set.iter().cloned());
        }
        all.push(format!("data.path={}", data.display()));
        all.push(format!("train.seed={seed}"));
        RunConfig::load(&self.config, &all)
    }

    /// Whether `r` runs on `recipe` at all (it names no recipes, or names this one).
    fn runs_on(&self, recipe: &Recipe, r: &RunSpec) -> bool {
        r.recipes.as_ref().is_none_or(|l| l.contains(&recipe.name))
    }

    /// The seeds `r` runs on `recipe`: those both list (each default: all the spec's), none
    /// where `r` names other recipes.
    fn seeds_of(&self, recipe: &Recipe, r: &RunSpec) -> Vec<u64> {
        if !self.runs_on(recipe, r) {
            return Vec::new();
        }
        let listed = |s: &Option<Vec<u64>>, x: &u64| s.as_ref().is_none_or(|l| l.contains(x));
        self.seeds
            .iter()
            .copied()
            .filter(|x| listed(&recipe.seeds, x) && listed(&r.seeds, x))
            .collect()
    }

    fn baseline(&self) -> &str {
        self.baseline.as_deref().expect("set by load")
    }

    /// Whether the spec is a grid (lists recipes).
    fn is_grid(&self) -> bool {
        !self.recipe[0].name.is_empty()
    }

    /// `run `x`` or `run `x` of recipe `y``, for messages.
    fn label(&self, recipe: &Recipe, r: &RunSpec) -> String {
        if recipe.name.is_empty() {
            format!("run `{}`", r.name)
        } else {
            format!("run `{}` of recipe `{}`", r.name, recipe.name)
        }
    }

    /// Where a run of a recipe keeps its seeds: `<out>/<run>`, or `<out>/<recipe>/<run>`.
    fn dir_of(&self, out: &Path, recipe: &Recipe, r: &RunSpec) -> PathBuf {
        out.join(&recipe.name).join(&r.name)
    }

    /// The corpus and held-out texts of a recipe.
    fn data_of<'a>(&'a self, recipe: &'a Recipe) -> (&'a DataSpec, &'a [PathBuf]) {
        (
            recipe.data.as_ref().unwrap_or(&self.data),
            recipe.eval_texts.as_deref().unwrap_or(&self.eval_texts),
        )
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
    /// Train nothing: write the tables and plots of the runs finished so far (a grid takes
    /// hours; a recipe whose baseline has not finished is left out).
    #[arg(long)]
    pub summarize: bool,
    #[arg(long, default_value = "runs/experiment")]
    pub out: PathBuf,
    #[arg(long, value_enum, default_value_t = DeviceChoice::Auto)]
    pub device: DeviceChoice,
}

/// `spes experiment`.
pub fn command(a: Args) -> Result<()> {
    if a.summarize {
        return summarize(&Spec::load(&a.spec)?, &a.out);
    }
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
    let cells: Vec<(&Recipe, &RunSpec)> = spec
        .recipe
        .iter()
        .flat_map(|c| spec.run.iter().map(move |r| (c, r)))
        .collect();
    let total: usize = cells.iter().map(|(c, r)| spec.seeds_of(c, r).len()).sum();
    let mut done = 0;
    for &seed in &spec.seeds {
        for &(recipe, r) in cells
            .iter()
            .filter(|(c, r)| spec.seeds_of(c, r).contains(&seed))
        {
            done += 1;
            let dir = spec.dir_of(out, recipe, r).join(format!("seed-{seed}"));
            let result = dir.join("result.json");
            if result.exists() {
                continue;
            }
            let (data_spec, texts) = spec.data_of(recipe);
            let data = match &recipe.data {
                None => prepare_data(data_spec, &out.join("data"))?,
                Some(own) => prepare_data(own, &out.join(format!("data-{}", recipe.name)))?,
            };
            let cfg = spec.config_of(recipe, r, &data, seed)?;
            let label = spec.label(recipe, r);
            println!("[{done}/{total}] {label} seed {seed}: {}", dir.display());
            let started = Instant::now();
            train(&cfg, &dir, device, device_arg)
                .with_context(|| format!("{label} seed {seed} failed"))?;
            let res = measure(texts, r, seed, &cfg, &dir, started, device)?;
            println!(
                "    final validation CE {:.4} (best {:.4}; every validation window {:.4}) in {:.0} s",
                res.final_ce,
                res.best_ce,
                res.val_ce.unwrap_or(f64::NAN),
                res.wall_s
            );
            spes_data::shard::write_atomic(
                &result,
                serde_json::to_string_pretty(&res)?.as_bytes(),
            )?;
        }
    }
    summarize(&spec, out)
}

/// Tokenizes a spec's inputs (or the embedded corpus) into `data` unless already there.
fn prepare_data(d: &DataSpec, data: &Path) -> Result<PathBuf> {
    if d.inputs.is_empty() {
        return demo::prepare_data(data.parent().unwrap_or(Path::new(".")));
    }
    if !data.join(spes_data::shard::MANIFEST).exists() {
        let source = match (&d.tokenizer, d.vocab) {
            (Some(t), _) => TokenizerSource::File(t.clone()),
            (None, v) => TokenizerSource::Train(v.unwrap_or(8192)),
        };
        let inputs = d.inputs.iter().map(|p| p.display().to_string()).collect();
        let mut opts = TokenizeOptions::new(inputs, data.to_owned(), source);
        if let Some(f) = d.val_fraction {
            opts.val_fraction = f;
        }
        let m = spes_data::tokenize(&opts)?.manifest;
        println!(
            "tokenized {} train / {} validation tokens, vocab {}",
            m.train_tokens, m.val_tokens, m.vocab_size
        );
    }
    Ok(data.to_owned())
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
    texts: &[PathBuf],
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
    for text in texts {
        let body = std::fs::read_to_string(text)
            .with_context(|| format!("cannot read {}", text.display()))?;
        let s = spes_eval::score_text(&model, &sc, &body)?;
        held_out_ce.push(s.nll / s.predicted_tokens as f64);
        held_out_bpb.push(s.bits_per_byte);
    }
    let val = spes_data::loader::ValWindows::open_mixture(&cfg.data.sources(), cfg.train.seq_len)?;
    let val_ce = spes_train::every_window_loss(&model, &val, device);
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
        val_ce: Some(val_ce),
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

/// Writes `results.json`, `results.md` and the validation-CE plots from every finished run
/// under `out`: a grid table of each run's ratio per recipe (grids only), then every run's row.
fn summarize(spec: &Spec, out: &Path) -> Result<()> {
    let pm = |(m, s): (f64, f64), n: usize| {
        if n > 1 {
            format!("{m:.4} ± {s:.4}")
        } else {
            format!("{m:.4}")
        }
    };
    let grid = spec.is_grid();
    let mut md = format!(
        "Validation cross-entropy (nats/token), mean ± half the spread over seeds {:?} (or \
         those a run lists); ratios are to `{}` of the same seed{}, then averaged. *All \
         windows*: the final model scored on every window of the validation split, the same \
         windows for every run of a {}.\n\n",
        spec.seeds,
        spec.baseline(),
        if grid { " and recipe" } else { "" },
        if grid { "recipe" } else { "spec" },
    );
    let mut grid_md = String::new();
    if grid {
        grid_md += &format!(
            "| recipe | what differs | tokens | `{}` CE (all windows) |",
            spec.baseline()
        );
        let others: Vec<&RunSpec> = spec
            .run
            .iter()
            .filter(|r| r.name != spec.baseline())
            .collect();
        for r in &others {
            grid_md += &format!(" `{}` ratio |", r.name);
        }
        grid_md += "\n|---|---|---|---|";
        grid_md += &"---|".repeat(others.len());
        grid_md += "\n";
    }
    let mut detail = String::from("| ");
    if grid {
        detail += "recipe | ";
    }
    detail += "run | seeds | final val CE | ratio | best val CE | all windows CE | ratio |";
    let mut rows = String::new();
    let mut json_rows = Vec::new();
    let mut texts_header: Option<Vec<String>> = None;
    for recipe in &spec.recipe {
        let (_, texts) = spec.data_of(recipe);
        let texts: Vec<String> = texts
            .iter()
            .map(|p| {
                p.file_name()
                    .unwrap_or_default()
                    .to_string_lossy()
                    .into_owned()
            })
            .collect();
        if texts_header.is_none() {
            for t in &texts {
                detail += &format!(" {t} CE | ratio |");
            }
            texts_header = Some(texts.clone());
        }
        let base = spec
            .run
            .iter()
            .position(|r| r.name == spec.baseline())
            .expect("checked by load");
        // Finished runs only (a result.json), and of each seed only where the baseline's is
        // finished too, so that a grid still training can be summarized.
        let finished = |r: &RunSpec| -> Result<Vec<RunResult>> {
            let mut per_seed = Vec::new();
            for seed in spec.seeds_of(recipe, r) {
                let path = spec
                    .dir_of(out, recipe, r)
                    .join(format!("seed-{seed}/result.json"));
                if !path.exists() {
                    continue;
                }
                let text = std::fs::read_to_string(&path)
                    .with_context(|| format!("cannot read {}", path.display()))?;
                per_seed.push(
                    serde_json::from_str(&text)
                        .with_context(|| format!("{} is not a run's result", path.display()))?,
                );
            }
            Ok(per_seed)
        };
        let mut results = spec.run.iter().map(finished).collect::<Result<Vec<_>>>()?;
        let baseline_seeds: Vec<u64> = results[base].iter().map(|b| b.seed).collect();
        if baseline_seeds.is_empty() {
            continue;
        }
        for per_seed in &mut results {
            per_seed.retain(|a| baseline_seeds.contains(&a.seed));
        }
        // Each seed's value over the baseline's of the same seed.
        let ratios = |rs: &[RunResult], f: &dyn Fn(&RunResult) -> f64| -> Vec<f64> {
            rs.iter()
                .map(|a| {
                    let b = results[base].iter().find(|b| b.seed == a.seed);
                    f(a) / f(b.expect("the baseline runs every seed"))
                })
                .collect()
        };
        let all_windows = |x: &RunResult| x.val_ce.unwrap_or(f64::NAN);
        if grid {
            let b = &results[base];
            let ce = mean_spread(&b.iter().map(all_windows).collect::<Vec<_>>());
            grid_md += &format!(
                "| {} | {} | {} | {} |",
                recipe.name,
                recipe.about,
                b[0].tokens,
                pm(ce, b.len())
            );
        }
        for (r, rs) in spec.run.iter().zip(&results) {
            if rs.is_empty() {
                if grid {
                    grid_md += " — |";
                }
                continue;
            }
            let col = |f: &dyn Fn(&RunResult) -> f64| rs.iter().map(f).collect::<Vec<f64>>();
            let n = rs.len();
            let final_ce = mean_spread(&col(&|x| x.final_ce));
            let ratio = mean_spread(&ratios(rs, &|x| x.final_ce));
            let all = mean_spread(&col(&all_windows));
            let all_ratio = mean_spread(&ratios(rs, &all_windows));
            if grid && r.name != spec.baseline() {
                grid_md += &format!(" {} ({n}) |", pm(all_ratio, n));
            }
            rows += "| ";
            if grid {
                rows += &format!("{} | ", recipe.name);
            }
            rows += &format!(
                "{} | {n} | {} | {} | {} | {} | {} |",
                r.name,
                pm(final_ce, n),
                pm(ratio, n),
                pm(mean_spread(&col(&|x| x.best_ce)), n),
                pm(all, n),
                pm(all_ratio, n),
            );
            let mut held = Vec::new();
            for (i, text) in texts.iter().enumerate() {
                let ce = mean_spread(&col(&|x| x.held_out_ce[i]));
                let ratio = mean_spread(&ratios(rs, &|x| x.held_out_ce[i]));
                rows += &format!(" {} | {} |", pm(ce, n), pm(ratio, n));
                held.push(serde_json::json!({"text": text, "ce": ce.0, "ratio": ratio.0}));
            }
            let wall = mean_spread(&col(&|x| x.wall_s)).0;
            let opt = rs[0].optimizer_bytes as f64 / (1 << 20) as f64;
            let traffic = rs[0].bytes_per_round / (1 << 20) as f64;
            rows += &format!(
                " {} | {wall:.0} | {opt:.1} | {traffic:.1} |\n",
                rs[0].tokens
            );
            json_rows.push(serde_json::json!({
                "recipe": recipe.name, "run": r.name, "seeds": spec.seeds_of(recipe, r),
                "final_ce": final_ce.0, "final_ce_spread": final_ce.1,
                "ratio": ratio.0, "ratio_spread": ratio.1,
                "all_windows_ce": all.0, "all_windows_ratio": all_ratio.0,
                "all_windows_ratio_spread": all_ratio.1, "held_out": held,
                "tokens": rs[0].tokens, "wall_s": wall, "optimizer_bytes": rs[0].optimizer_bytes,
                "bytes_per_round": rs[0].bytes_per_round,
            }));
        }
        if grid {
            grid_md += "\n";
        }
        // From a tenth of the budget on: the first evaluations would flatten the differences.
        let from = results[base][0].tokens as f64 / 10.0;
        let series: Vec<(String, Vec<(f64, f64)>)> = spec
            .run
            .iter()
            .zip(&results)
            .filter(|(_, rs)| !rs.is_empty())
            .map(|(r, rs)| {
                let curve = mean_curve(rs).into_iter().filter(|p| p.0 >= from);
                (r.name.clone(), curve.collect())
            })
            .collect();
        let plot = if grid {
            format!("val_ce-{}.png", recipe.name)
        } else {
            "val_ce.png".to_owned()
        };
        report::loss_plot(
            &out.join(&plot),
            "validation CE (mean over seeds), from 10 % of the tokens",
            &series,
        )?;
    }
    detail += " tokens | wall s | optimizer MiB / node | MiB / node round |\n|---|---|---|---|---|---|---|";
    if grid {
        detail += "---|";
    }
    detail += &"---|---|".repeat(texts_header.map_or(0, |t| t.len()));
    detail += "---|---|---|---|\n";
    md += &grid_md;
    if grid {
        md += "\n";
    }
    md += &detail;
    md += &rows;
    if !grid {
        md += "\n![validation CE against tokens](val_ce.png)\n";
    }
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
            let spec =
                Spec::read(&path, false).unwrap_or_else(|e| panic!("{}: {e:#}", path.display()));
            for recipe in &spec.recipe {
                for r in &spec.run {
                    let cfg = spec
                        .config_of(recipe, r, Path::new("data"), spec.seeds[0])
                        .unwrap();
                    if cfg.sync.mode == Mode::Centralized {
                        assert_eq!(cfg.train.node_lr(), 3e-3, "{}: {}", path.display(), r.name);
                        assert_eq!(cfg.train.expert_lr_scale, 1.0, "{}", path.display());
                    }
                }
            }
            checked += 1;
        }
        assert!(checked >= 4, "only {checked} specs in {}", dir.display());
    }

    /// A grid: every run on every recipe (or those it names), each recipe's baseline with its
    /// own overrides, seeds narrowed by recipe and run, and budgets checked per recipe.
    #[test]
    fn a_grid_crosses_runs_with_recipes() {
        let tmp = tempfile::tempdir().unwrap();
        let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs/spes-tiny.toml");
        std::fs::write(tmp.path().join("a.txt"), "text").unwrap();
        let spec = |central_batch: u32| {
            format!(
                r#"config = {config:?}
seeds = [0, 1]
baseline = "c"
[data]
inputs = ["a.txt"]
[[run]]
name = "c"
set = ["sync.mode=centralized"]
[[run]]
name = "s"
set = ["sync.mode=spes"]
[[run]]
name = "v"
seeds = [0]
recipes = ["two"]
set = ["sync.mode=spes", "sync.merge_every=0", "train.grad_accum=2", "train.max_steps=250"]
[[recipe]]
name = "four"
set = ["sync.nodes=4", "train.max_steps=250"]
baseline_set = ["train.batch_size=16"]
[[recipe]]
name = "two"
seeds = [1]
set = ["sync.nodes=2", "train.max_steps=500"]
baseline_set = ["train.batch_size={central_batch}"]
"#,
                config = config.display().to_string(),
            )
        };
        let path = tmp.path().join("grid.toml");
        std::fs::write(&path, spec(7)).unwrap();
        let e = format!("{:#}", Spec::load(&path).unwrap_err());
        assert!(
            e.contains("run `s` of recipe `two` trains on 1024000 tokens, `c` on 896000"),
            "{e}"
        );
        std::fs::write(&path, spec(8)).unwrap();
        let g = Spec::load(&path).unwrap();
        assert!(g.is_grid());
        let (four, two) = (&g.recipe[0], &g.recipe[1]);
        let [c, s, v] = [&g.run[0], &g.run[1], &g.run[2]];
        assert_eq!(g.seeds_of(four, s), [0, 1]);
        assert_eq!(g.seeds_of(two, s), [1]);
        assert!(g.seeds_of(four, v).is_empty(), "v runs on `two` only");
        assert!(
            g.seeds_of(two, v).is_empty(),
            "v's seed 0 is not one of `two`'s"
        );
        let at = |r, run| g.config_of(r, run, Path::new("d"), 0).unwrap();
        assert_eq!(at(two, c).train.batch_size, 8, "the baseline's own batch");
        assert_eq!(at(two, s).train.batch_size, 4, "the config's");
        assert_eq!(
            at(two, s).sync.merge_until,
            375,
            "rules see the recipe: three quarters of its 500 steps"
        );
        assert_eq!(g.dir_of(Path::new("o"), two, s), Path::new("o/two/s"));
        let bad = spec(8).replace("recipes = [\"two\"]", "recipes = [\"three\"]");
        std::fs::write(&path, bad).unwrap();
        let e = format!("{:#}", Spec::load(&path).unwrap_err());
        assert!(
            e.contains("run `v`: recipe `three` is not a [[recipe]]"),
            "{e}"
        );

        // A grid still training summarizes what has finished: `four` with the seed its
        // baseline has, not `two`, whose baseline has not finished.
        let out = tmp.path().join("out");
        let finish = |recipe: &Recipe, r: &RunSpec, seed: u64, ce: f64| {
            let dir = g.dir_of(&out, recipe, r).join(format!("seed-{seed}"));
            std::fs::create_dir_all(&dir).unwrap();
            let res = RunResult {
                name: r.name.clone(),
                seed,
                mode: Mode::Spes,
                tokens: 1_024_000,
                final_ce: ce,
                best_ce: ce,
                curve: vec![(0.0, 9.0), (1_024_000.0, ce)],
                held_out_ce: vec![],
                held_out_bpb: vec![],
                val_ce: Some(ce),
                wall_s: 1.0,
                optimizer_bytes: 0,
                bytes_per_round: 0.0,
            };
            std::fs::write(
                dir.join("result.json"),
                serde_json::to_string(&res).unwrap(),
            )
            .unwrap();
        };
        finish(four, c, 0, 4.0);
        finish(four, s, 0, 4.2);
        finish(four, s, 1, 9.9);
        finish(two, s, 1, 5.0);
        summarize(&g, &out).unwrap();
        let md = std::fs::read_to_string(out.join("results.md")).unwrap();
        assert!(
            md.contains("| four |  | 1024000 | 4.0000 | 1.0500 (1) | — |"),
            "{md}"
        );
        assert!(!md.contains("| two |"), "{md}");
    }
}
