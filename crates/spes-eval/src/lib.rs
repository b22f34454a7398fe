//! Scoring a model: perplexity and bits per byte of a text, and ranked-classification tasks in
//! the `requests.jsonl.gz` format of OLMo's evaluation suite (`acc_raw`, `acc_per_char`).
//!
//! Text: the whole text is tokenized at once (no special tokens) and cut into non-overlapping
//! windows of `ctx` tokens; within each window every token but the first is predicted from the
//! ones before it. perplexity = exp(total NLL / predicted tokens); bits per byte = total NLL /
//! (ln 2 · UTF-8 bytes of the text).
//!
//! Tasks: each request's continuation is scored as the sum of its token log-probabilities given
//! the context, encoded as lm-eval-harness does (`enc(context + continuation)` split after
//! `enc(context)`); too-long inputs keep their last `ctx` tokens.

use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use spes_model::MoeModel;
use std::collections::BTreeMap;
use std::io::BufRead;
use std::path::Path;
use tch::{Device, Kind, Tensor};
use tokenizers::Tokenizer;

/// What scoring needs besides the model.
pub struct Scoring {
    pub tokenizer: Tokenizer,
    /// End-of-text id: the context of a request with an empty context.
    pub eos: u32,
    /// Window length: the training sequence length.
    pub ctx: usize,
    pub batch: usize,
    pub device: Device,
}

/// Result of scoring a text.
#[derive(Clone, Debug, Serialize)]
pub struct TextScore {
    pub perplexity: f64,
    pub bits_per_byte: f64,
    /// Tokens in the text.
    pub tokens: usize,
    /// Tokens that were predicted (all but the first of each window).
    pub predicted_tokens: usize,
    pub bytes: usize,
    pub nll: f64,
}

fn encode(tok: &Tokenizer, text: &str) -> Result<Vec<u32>> {
    Ok(tok
        .encode(text, false)
        .map_err(|e| anyhow::anyhow!("tokenizer failed: {e}"))?
        .get_ids()
        .to_vec())
}

/// Sum of log p(targets) over the marked positions of each row, for right-padded rows.
/// `rows[i] = (input ids, target ids, number of trailing targets to count)`.
fn row_logprobs(
    model: &MoeModel,
    rows: &[(Vec<u32>, Vec<u32>, usize)],
    pad: u32,
    device: Device,
) -> Vec<f64> {
    let width = rows.iter().map(|r| r.0.len()).max().unwrap_or(1);
    let mut inputs = Vec::with_capacity(rows.len() * width);
    let mut targets = Vec::with_capacity(rows.len() * width);
    let mut mask = Vec::with_capacity(rows.len() * width);
    for (inp, tgt, count) in rows {
        let n = inp.len();
        for j in 0..width {
            inputs.push(*inp.get(j).unwrap_or(&pad) as i64);
            targets.push(*tgt.get(j).unwrap_or(&pad) as i64);
            mask.push(if j < n && j >= n - count { 1f32 } else { 0.0 });
        }
    }
    let shape = [rows.len() as i64, width as i64];
    let inputs = Tensor::from_slice(&inputs).view(shape).to_device(device);
    let targets = Tensor::from_slice(&targets).view(shape).to_device(device);
    let mask = Tensor::from_slice(&mask).view(shape).to_device(device);
    tch::no_grad(|| {
        let (logits, _) = model.forward(&inputs);
        let logp = logits.to_kind(Kind::Double).log_softmax(-1, Kind::Double);
        let picked = logp
            .gather(2, &targets.unsqueeze(-1), false)
            .squeeze_dim(-1);
        let sums = (picked * mask.to_kind(Kind::Double)).sum_dim_intlist(1, false, Kind::Double);
        Vec::<f64>::try_from(&sums.to_device(Device::Cpu)).expect("double vector")
    })
}

/// Perplexity and bits per byte of `text` in windows of `ctx` tokens, `batch` windows at a time.
pub fn score_text(model: &MoeModel, sc: &Scoring, text: &str) -> Result<TextScore> {
    let (ctx, batch, device) = (sc.ctx, sc.batch, sc.device);
    let ids = encode(&sc.tokenizer, text)?;
    if ids.len() < 2 {
        bail!("the text has {} tokens; at least 2 are needed", ids.len());
    }
    let rows: Vec<(Vec<u32>, Vec<u32>, usize)> = ids
        .chunks(ctx)
        .filter(|w| w.len() >= 2)
        .map(|w| (w[..w.len() - 1].to_vec(), w[1..].to_vec(), w.len() - 1))
        .collect();
    let predicted: usize = rows.iter().map(|r| r.2).sum();
    let mut nll = 0.0;
    for group in rows.chunks(batch.max(1)) {
        nll -= row_logprobs(model, group, 0, device).iter().sum::<f64>();
    }
    Ok(TextScore {
        perplexity: (nll / predicted as f64).exp(),
        bits_per_byte: nll / (std::f64::consts::LN_2 * text.len() as f64),
        tokens: ids.len(),
        predicted_tokens: predicted,
        bytes: text.len(),
        nll,
    })
}

/// One (context, continuation) request of a ranked-classification task.
#[derive(Clone, Debug)]
pub struct Request {
    pub doc_id: u64,
    pub context: String,
    pub continuation: String,
    pub gold: u64,
    /// Index of this choice within its document.
    pub choice: u64,
}

/// A task: its name and requests, grouped by document in file order.
pub struct Task {
    pub name: String,
    pub requests: Vec<Request>,
}

/// Reads `<dir>/requests.jsonl.gz` (and the name from `config.json`).
pub fn load_task(dir: &Path) -> Result<Task> {
    let path = dir.join("requests.jsonl.gz");
    let file = std::fs::File::open(&path)
        .with_context(|| format!("cannot open task file {}", path.display()))?;
    let reader = std::io::BufReader::new(flate2::read::GzDecoder::new(file));
    let mut requests = Vec::new();
    for (i, line) in reader.lines().enumerate() {
        let line = line.with_context(|| format!("{}: read error", path.display()))?;
        if line.trim().is_empty() {
            continue;
        }
        let v: serde_json::Value = serde_json::from_str(&line)
            .with_context(|| format!("{}:{}: not JSON", path.display(), i + 1))?;
        let field = |p: &str| -> Result<&serde_json::Value> {
            let value = p.split('.').fold(&v, |acc, k| &acc[k]);
            if value.is_null() {
                bail!("{}:{}: missing `{p}`", path.display(), i + 1);
            }
            Ok(value)
        };
        requests.push(Request {
            doc_id: field("doc_id")?.as_u64().context("doc_id")?,
            context: field("request.context")?
                .as_str()
                .context("context")?
                .to_owned(),
            continuation: field("request.continuation")?
                .as_str()
                .context("continuation")?
                .to_owned(),
            gold: field("doc.gold")?.as_u64().context("doc.gold")?,
            choice: field("idx")?.as_u64().context("idx")?,
        });
    }
    let name = std::fs::read_to_string(dir.join("config.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .and_then(|c| c["task_name"].as_str().map(str::to_owned))
        .unwrap_or_else(|| {
            dir.file_name()
                .unwrap_or_default()
                .to_string_lossy()
                .to_string()
        });
    Ok(Task { name, requests })
}

/// lm-eval-harness's pair encoding: trailing spaces of the context move to the continuation,
/// and the continuation is what `enc(context + continuation)` adds after `enc(context)`.
pub fn encode_pair(
    tok: &Tokenizer,
    context: &str,
    continuation: &str,
) -> Result<(Vec<u32>, Vec<u32>)> {
    let trimmed = context.trim_end_matches(' ');
    let moved = &context[trimmed.len()..];
    let continuation = format!("{moved}{continuation}");
    let whole = encode(tok, &format!("{trimmed}{continuation}"))?;
    let ctx = encode(tok, trimmed)?;
    let split = ctx.len().min(whole.len());
    Ok((whole[..split].to_vec(), whole[split..].to_vec()))
}

/// Sum of continuation log-probabilities for each (context ids, continuation ids) pair.
/// An empty context is replaced by `eos`; inputs keep their last `ctx` tokens.
pub fn loglikelihoods(
    model: &MoeModel,
    pairs: &[(Vec<u32>, Vec<u32>)],
    eos: u32,
    ctx: usize,
    batch: usize,
    device: Device,
    progress: &ProgressBar,
) -> Vec<f64> {
    let rows: Vec<(Vec<u32>, Vec<u32>, usize)> = pairs
        .iter()
        .map(|(c, k)| {
            let mut ids = if c.is_empty() { vec![eos] } else { c.clone() };
            ids.extend_from_slice(k);
            let keep = ids.len().min(ctx + 1);
            let ids = &ids[ids.len() - keep..];
            let count = k.len().min(keep - 1);
            (ids[..ids.len() - 1].to_vec(), ids[1..].to_vec(), count)
        })
        .collect();
    // Longest first, so batches hold rows of similar length.
    let mut order: Vec<usize> = (0..rows.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(rows[i].0.len()));
    let mut out = vec![0.0; rows.len()];
    for group in order.chunks(batch.max(1)) {
        let batch_rows: Vec<_> = group.iter().map(|&i| rows[i].clone()).collect();
        for (&i, lp) in group
            .iter()
            .zip(row_logprobs(model, &batch_rows, eos, device))
        {
            out[i] = lp;
        }
        progress.inc(group.len() as u64);
    }
    out
}

/// Accuracy of a task.
#[derive(Clone, Debug, Serialize)]
pub struct TaskScore {
    pub task: String,
    pub docs: usize,
    pub requests: usize,
    pub acc_raw: f64,
    pub acc_per_char: f64,
}

/// Scores the first `limit` documents of a task (all if `None`).
pub fn score_task(
    model: &MoeModel,
    sc: &Scoring,
    task: &Task,
    limit: Option<usize>,
    show_progress: bool,
) -> Result<TaskScore> {
    let tok = &sc.tokenizer;
    let mut docs: BTreeMap<u64, Vec<&Request>> = BTreeMap::new();
    for r in &task.requests {
        docs.entry(r.doc_id).or_default().push(r);
    }
    let chosen: Vec<&Request> = docs
        .values()
        .take(limit.unwrap_or(usize::MAX))
        .flatten()
        .copied()
        .collect();
    let pairs = chosen
        .iter()
        .map(|r| encode_pair(tok, &r.context, &r.continuation))
        .collect::<Result<Vec<_>>>()?;
    let bar = if show_progress {
        let bar = ProgressBar::new(pairs.len() as u64);
        bar.set_style(
            ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} requests, eta {eta}")
                .expect("valid template")
                .progress_chars("=> "),
        );
        bar.set_message(task.name.clone());
        bar
    } else {
        ProgressBar::hidden()
    };
    let scores = loglikelihoods(model, &pairs, sc.eos, sc.ctx, sc.batch, sc.device, &bar);
    bar.finish_and_clear();
    let mut by_doc: BTreeMap<u64, Vec<(f64, f64, u64, u64)>> = BTreeMap::new();
    for (r, s) in chosen.iter().zip(&scores) {
        let chars = r.continuation.chars().count().max(1) as f64;
        by_doc
            .entry(r.doc_id)
            .or_default()
            .push((*s, s / chars, r.choice, r.gold));
    }
    let argmax = |v: &[(f64, f64, u64, u64)], f: fn(&(f64, f64, u64, u64)) -> f64| {
        v.iter().max_by(|a, b| f(a).total_cmp(&f(b))).map(|x| x.2)
    };
    let (mut raw, mut per_char) = (0usize, 0usize);
    for choices in by_doc.values() {
        let gold = choices[0].3;
        raw += (argmax(choices, |c| c.0) == Some(gold)) as usize;
        per_char += (argmax(choices, |c| c.1) == Some(gold)) as usize;
    }
    let n = by_doc.len().max(1) as f64;
    Ok(TaskScore {
        task: task.name.clone(),
        docs: by_doc.len(),
        requests: chosen.len(),
        acc_raw: raw as f64 / n,
        acc_per_char: per_char as f64 / n,
    })
}
