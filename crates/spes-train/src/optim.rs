//! AdamW over the trainable tensors only, the learning-rate schedule and gradient clipping.
//!
//! The moments are our own tensors (not tch's opaque optimizer) so they can be saved, restored
//! bit-exactly and measured. A frozen tensor is never given to the optimizer, so it has no state.

use crate::config::TrainConfig;
use anyhow::{bail, Context, Result};
use spes_model::{Param, Role};
use std::collections::HashMap;
use tch::{Kind, Tensor};

/// PyTorch-equivalent AdamW (decoupled weight decay, bias correction), run by libtorch's
/// fused kernel through spes-ext (`tests::fused_matches_the_reference_loop` keeps the
/// per-tensor formula as the reference).
pub struct AdamW {
    names: Vec<String>,
    /// The trained tensors (sharing storage with the model's).
    weights: Vec<Tensor>,
    exp_avg: Vec<Tensor>,
    exp_avg_sq: Vec<Tensor>,
    /// Per tensor, the value of `steps` when its moments started: 0, or the step at which a
    /// node adopted it mid-run. Bias correction counts from there, as for a fresh optimizer.
    started: Vec<i64>,
    /// Per tensor, `steps - started` as an fp32 scalar on its device: the fused kernel reads
    /// bias correction from these without a host sync.
    counts: Vec<Tensor>,
    /// Per tensor, whether it is an expert matrix (stepped at `lr · expert_lr_scale`).
    expert: Vec<bool>,
    /// Per tensor a `"union_estimate"` node estimates for, the average of its gradient's noise
    /// variance ([`AdamW::step_with_noise`]), made at its first such step.
    noise: HashMap<String, Tensor>,
    /// Optimizer steps taken.
    pub steps: i64,
    expert_lr_scale: f64,
    beta1: f64,
    beta2: f64,
    eps: f64,
    weight_decay: f64,
}

/// A zero-filled tensor like `t`, outside autograd.
fn zeros_like(t: &Tensor) -> Tensor {
    t.zeros_like().detach()
}

/// A step counter for a tensor: an fp32 scalar on its device.
fn counter(t: &Tensor, value: i64) -> Tensor {
    Tensor::full([], value as f64, (Kind::Float, t.device()))
}

impl AdamW {
    /// State for exactly these parameters, zero-initialised.
    pub fn new(params: Vec<Param>, cfg: &TrainConfig) -> Self {
        let mut opt = AdamW {
            names: Vec::new(),
            weights: Vec::new(),
            exp_avg: Vec::new(),
            exp_avg_sq: Vec::new(),
            started: Vec::new(),
            counts: Vec::new(),
            expert: Vec::new(),
            noise: HashMap::new(),
            steps: 0,
            expert_lr_scale: cfg.expert_lr_scale,
            beta1: cfg.beta1,
            beta2: cfg.beta2,
            eps: cfg.eps,
            weight_decay: cfg.weight_decay,
        };
        for p in params {
            opt.push(p, None, 0);
        }
        opt
    }

    fn push(&mut self, p: Param, moments: Option<(Tensor, Tensor)>, started: i64) {
        let w = p.tensor;
        let (m, v) = moments.unwrap_or_else(|| (zeros_like(&w), zeros_like(&w)));
        self.counts.push(counter(&w, self.steps - started));
        self.expert.push(matches!(p.role, Role::Expert { .. }));
        self.names.push(p.name);
        self.exp_avg.push(m);
        self.exp_avg_sq.push(v);
        self.started.push(started);
        self.weights.push(w);
    }

    /// Names of the tensors this optimizer updates.
    pub fn param_names(&self) -> impl Iterator<Item = &str> {
        self.names.iter().map(String::as_str)
    }

    /// Bytes of optimizer state (both moments).
    pub fn state_bytes(&self) -> u64 {
        self.exp_avg
            .iter()
            .chain(&self.exp_avg_sq)
            .chain(self.noise.values())
            .map(|t| (t.numel() * t.kind().elt_size_in_bytes()) as u64)
            .sum()
    }

    /// Trains exactly `params` from now on: tensors it already trained keep their moments,
    /// new ones start fresh (zero moments, bias correction from this step), and tensors no
    /// longer trained lose theirs. Used when a node's expert ownership changes.
    pub fn retarget(&mut self, params: Vec<Param>) -> Retarget {
        self.retarget_with(params, HashMap::new())
    }

    /// [`AdamW::retarget`], where `incoming` brings the moments of tensors this optimizer did
    /// not hold (another data-parallel rank did), keyed by name.
    pub fn retarget_with(
        &mut self,
        params: Vec<Param>,
        incoming: HashMap<String, Moments>,
    ) -> Retarget {
        let mut old: HashMap<String, Moments> = incoming;
        let mut noise = std::mem::take(&mut self.noise);
        let held: HashMap<String, Moments> = self
            .names
            .drain(..)
            .zip(self.exp_avg.drain(..))
            .zip(self.exp_avg_sq.drain(..))
            .zip(self.started.drain(..))
            .map(|(((n, exp_avg), exp_avg_sq), started)| {
                let noise = noise.remove(&n);
                (
                    n,
                    Moments {
                        exp_avg,
                        exp_avg_sq,
                        started,
                        noise,
                    },
                )
            })
            .collect();
        old.extend(held);
        self.weights.clear();
        self.counts.clear();
        self.expert.clear();
        let mut report = Retarget::default();
        for p in params {
            match old.remove(&p.name) {
                Some(m) => {
                    report.kept += 1;
                    if let Some(n) = m.noise {
                        self.noise.insert(p.name.clone(), n);
                    }
                    self.push(p, Some((m.exp_avg, m.exp_avg_sq)), m.started);
                }
                None => {
                    report.fresh.push(p.name.clone());
                    let now = self.steps;
                    self.push(p, None, now);
                }
            }
        }
        report.dropped = old.into_keys().collect();
        report.dropped.sort();
        report
    }

    /// The moments of tensor `name`, if this optimizer holds them (sharing storage).
    pub fn moments_of(&self, name: &str) -> Option<Moments> {
        let i = self.names.iter().position(|n| n == name)?;
        Some(Moments {
            exp_avg: self.exp_avg[i].shallow_clone(),
            exp_avg_sq: self.exp_avg_sq[i].shallow_clone(),
            started: self.started[i],
            noise: self.noise.get(name).map(Tensor::shallow_clone),
        })
    }

    /// The positions (in [`AdamW::param_names`]'s order) of the tensors that have a noise
    /// average ([`AdamW::step_with_noise`]).
    pub fn noise_held(&self) -> Vec<i64> {
        (0..self.names.len())
            .filter(|&i| self.noise.contains_key(&self.names[i]))
            .map(|i| i as i64)
            .collect()
    }

    /// The noise averages of the tensors at positions `which`, zero where this optimizer had
    /// none, sharing storage: what a data-parallel rank overwrites with rank 0's.
    pub fn noise_tensors(&mut self, which: &[i64]) -> Vec<Tensor> {
        which
            .iter()
            .map(|&i| {
                let (name, w) = (&self.names[i as usize], &self.weights[i as usize]);
                self.noise
                    .entry(name.clone())
                    .or_insert_with(|| zeros_like(w))
                    .shallow_clone()
            })
            .collect()
    }

    /// The step clock: optimizer steps taken and, per tensor, the step its moments started.
    pub fn clock(&self) -> (i64, Vec<i64>) {
        (self.steps, self.started.clone())
    }

    /// Sets the step clock (a data-parallel rank takes rank 0's); `started` as from
    /// [`AdamW::clock`], for the same tensors.
    pub fn set_clock(&mut self, steps: i64, started: &[i64]) {
        assert_eq!(started.len(), self.names.len(), "one start per tensor");
        self.steps = steps;
        self.started = started.to_vec();
        self.recount();
    }

    fn recount(&mut self) {
        for ((count, s), w) in self.counts.iter_mut().zip(&self.started).zip(&self.weights) {
            *count = counter(w, self.steps - s);
        }
    }

    /// The moment tensors, in order (both per tensor), for a broadcast between ranks.
    pub fn moment_tensors(&self) -> Vec<Tensor> {
        self.exp_avg
            .iter()
            .zip(&self.exp_avg_sq)
            .flat_map(|(m, v)| [m.shallow_clone(), v.shallow_clone()])
            .collect()
    }

    /// One update at learning rate `lr` (expert matrices: `lr · train.expert_lr_scale`) from the
    /// accumulated gradients. A tensor without a gradient is left alone, but its
    /// bias-correction clock still advances.
    pub fn step(&mut self, lr: f64) -> Result<()> {
        self.steps += 1;
        let grads: Vec<Tensor> = self.weights.iter().map(Tensor::grad).collect();
        let hyper = |lr| spes_ext::AdamWHyper {
            lr,
            beta1: self.beta1,
            beta2: self.beta2,
            weight_decay: self.weight_decay,
            eps: self.eps,
        };
        tch::no_grad(|| -> Result<()> {
            spes_ext::add_scalar(&self.counts, 1.0)?;
            if self.expert_lr_scale == 1.0 && grads.iter().all(Tensor::defined) {
                return Ok(spes_ext::fused_adamw(
                    &spes_ext::AdamWGroup {
                        params: &self.weights,
                        grads: &grads,
                        exp_avgs: &self.exp_avg,
                        exp_avg_sqs: &self.exp_avg_sq,
                        steps: &self.counts,
                    },
                    hyper(lr),
                )?);
            }
            // One fused call per learning rate, as PyTorch's param groups do.
            let scale_of = |i: usize| {
                if self.expert[i] {
                    self.expert_lr_scale
                } else {
                    1.0
                }
            };
            let scales: &[f64] = if self.expert_lr_scale == 1.0 {
                &[1.0]
            } else {
                &[1.0, self.expert_lr_scale]
            };
            for &scale in scales {
                let group: Vec<usize> = (0..grads.len())
                    .filter(|&i| grads[i].defined() && scale_of(i) == scale)
                    .collect();
                if group.is_empty() {
                    continue;
                }
                let pick = |ts: &[Tensor]| -> Vec<Tensor> {
                    group.iter().map(|&i| ts[i].shallow_clone()).collect()
                };
                spes_ext::fused_adamw(
                    &spes_ext::AdamWGroup {
                        params: &pick(&self.weights),
                        grads: &pick(&grads),
                        exp_avgs: &pick(&self.exp_avg),
                        exp_avg_sqs: &pick(&self.exp_avg_sq),
                        steps: &pick(&self.counts),
                    },
                    hyper(lr * scale),
                )?;
            }
            Ok(())
        })
    }

    /// One update as [`AdamW::step`] takes it, except that the second moment of each tensor
    /// named in `squares` is fed that tensor instead of its gradient's square (the oracle of
    /// `spes simulate --oracle second-moment`).
    pub fn step_with_second_moment(
        &mut self,
        lr: f64,
        squares: &HashMap<String, Tensor>,
    ) -> Result<()> {
        let b2 = self.beta2;
        self.unfused_step(lr, |name, g, v| {
            let _ = v.g_mul_scalar_(b2);
            let _ = match squares.get(name) {
                Some(fed) => v.g_add_(&fed.g_mul_scalar(1.0 - b2)),
                None => v.addcmul_(g, &g.g_mul_scalar(1.0 - b2)),
            };
            v.shallow_clone()
        })
    }

    /// One update as [`AdamW::step`] takes it, except that each tensor named in `noise` (the
    /// noise variance of its gradient, as `train.second_moment = "union_estimate"` measures
    /// it) divides by the second moment of the union of `nodes` nodes' batches instead of its
    /// own: the second moment less (1 − 1/nodes) times the noise, both averaged over steps
    /// alike, and at least 1/nodes of it. The noise average is state like the moments.
    pub fn step_with_noise(
        &mut self,
        lr: f64,
        noise: &HashMap<String, Tensor>,
        nodes: usize,
    ) -> Result<()> {
        let (b2, m) = (self.beta2, nodes.max(1) as f64);
        let mut averages = std::mem::take(&mut self.noise);
        let result = self.unfused_step(lr, |name, g, v| {
            let _ = v.g_mul_scalar_(b2);
            let _ = v.addcmul_(g, &g.g_mul_scalar(1.0 - b2));
            let Some(step) = noise.get(name) else {
                return v.shallow_clone();
            };
            let avg = averages
                .entry(name.to_string())
                .or_insert_with(|| zeros_like(v));
            let _ = avg.g_mul_scalar_(b2);
            let _ = avg.g_add_(&step.g_mul_scalar(1.0 - b2));
            (&*v - &*avg * (1.0 - 1.0 / m)).maximum(&(&*v / m))
        });
        self.noise = averages;
        result
    }

    /// PyTorch's AdamW formula, one tensor at a time, where `second(name, grad, v)` updates
    /// the second moment `v` in place and returns the one the step divides by.
    fn unfused_step(
        &mut self,
        lr: f64,
        mut second: impl FnMut(&str, &Tensor, &mut Tensor) -> Tensor,
    ) -> Result<()> {
        self.steps += 1;
        let (b1, b2, eps, wd) = (self.beta1, self.beta2, self.eps, self.weight_decay);
        tch::no_grad(|| -> Result<()> {
            spes_ext::add_scalar(&self.counts, 1.0)?;
            for i in 0..self.names.len() {
                let g = self.weights[i].grad();
                if !g.defined() {
                    continue;
                }
                let lr = if self.expert[i] {
                    lr * self.expert_lr_scale
                } else {
                    lr
                };
                let t = (self.steps - self.started[i]) as i32;
                let (bc1, bc2_sqrt) = (1.0 - b1.powi(t), (1.0 - b2.powi(t)).sqrt());
                let mut w = self.weights[i].shallow_clone();
                let mut m = self.exp_avg[i].shallow_clone();
                let mut v = self.exp_avg_sq[i].shallow_clone();
                let _ = w.g_mul_scalar_(1.0 - lr * wd);
                let _ = m.lerp_(&g, 1.0 - b1);
                let divide_by = second(&self.names[i], &g, &mut v);
                let denom = (divide_by.sqrt() / bc2_sqrt).g_add_scalar(eps);
                let _ = w.addcdiv_(&(&m * (-lr / bc1)), &denom);
            }
            Ok(())
        })
    }

    /// Each trained tensor's gradient by name, where it has one (sharing storage).
    pub fn named_grads(&self) -> Vec<(String, Tensor)> {
        self.names
            .iter()
            .zip(&self.weights)
            .map(|(n, w)| (n.clone(), w.grad()))
            .filter(|(_, g)| g.defined())
            .collect()
    }

    /// Scales the gradients as [`AdamW::clip_grad_norm`] would if their global norm were
    /// `norm` (an fp32 scalar): by `max_norm / norm` when that is below 1.
    pub fn clip_to(&self, norm: &Tensor, max_norm: f64) -> Result<()> {
        Ok(tch::no_grad(|| {
            spes_ext::clip_to_norm(&self.grads(), norm, max_norm)
        })?)
    }

    /// The gradients that exist (a tensor gets one at its first backward pass).
    fn grads(&self) -> Vec<Tensor> {
        self.weights
            .iter()
            .map(Tensor::grad)
            .filter(Tensor::defined)
            .collect()
    }

    /// Clears gradients (sets them to zero in place, keeping their buffers).
    pub fn zero_grad(&mut self) -> Result<()> {
        Ok(spes_ext::zero(&self.grads())?)
    }

    /// Scales gradients so their global L2 norm is at most `max_norm`; returns the pre-clip norm
    /// as a tensor (reading it is a host sync, so callers do it only when logging).
    pub fn clip_grad_norm(&self, max_norm: f64) -> Result<Tensor> {
        Ok(tch::no_grad(|| {
            spes_ext::clip_grad_norm(&self.grads(), max_norm)
        })?)
    }

    /// Named moments, for a checkpoint; `started.<name>` for tensors adopted mid-run.
    pub fn state(&self) -> Vec<(String, Tensor)> {
        let mut out = Vec::with_capacity(2 * self.names.len());
        for (((name, m), v), s) in self
            .names
            .iter()
            .zip(&self.exp_avg)
            .zip(&self.exp_avg_sq)
            .zip(&self.started)
        {
            out.push((format!("exp_avg.{name}"), m.shallow_clone()));
            out.push((format!("exp_avg_sq.{name}"), v.shallow_clone()));
            if *s != 0 {
                out.push((format!("started.{name}"), Tensor::from(*s)));
            }
            if let Some(n) = self.noise.get(name) {
                out.push((format!("noise.{name}"), n.shallow_clone()));
            }
        }
        out
    }

    /// Restores moments saved by [`AdamW::state`]; every trainable tensor must be present.
    pub fn load_state(
        &mut self,
        named: Vec<(String, Tensor)>,
        steps: i64,
        source: &str,
    ) -> Result<()> {
        let mut map: HashMap<String, Tensor> = named.into_iter().collect();
        self.noise.clear();
        for ((name, s), w) in self.names.iter().zip(&mut self.started).zip(&self.weights) {
            *s = match map.remove(&format!("started.{name}")) {
                Some(t) => t.int64_value(&[]),
                None => 0,
            };
            if let Some(n) = map.remove(&format!("noise.{name}")) {
                if n.size() != w.size() {
                    bail!(
                        "{source}: tensor `noise.{name}` has shape {:?}, expected {:?}",
                        n.size(),
                        w.size()
                    );
                }
                // A copy of its own, as the moments get: `n` may share the saver's storage.
                let mut own = zeros_like(w);
                tch::no_grad(|| own.copy_(&n));
                self.noise.insert(name.clone(), own);
            }
        }
        if map.len() != 2 * self.names.len() {
            bail!(
                "{source}: holds {} moment tensors, expected {} for the {} trainable tensors",
                map.len(),
                2 * self.names.len(),
                self.names.len()
            );
        }
        tch::no_grad(|| -> Result<()> {
            for ((name, m), v) in self
                .names
                .iter()
                .zip(&mut self.exp_avg)
                .zip(&mut self.exp_avg_sq)
            {
                for (prefix, dst) in [("exp_avg", m), ("exp_avg_sq", v)] {
                    let key = format!("{prefix}.{name}");
                    let src = map
                        .remove(&key)
                        .with_context(|| format!("{source}: missing tensor `{key}`"))?;
                    if src.size() != dst.size() {
                        bail!(
                            "{source}: tensor `{key}` has shape {:?}, expected {:?}",
                            src.size(),
                            dst.size()
                        );
                    }
                    dst.copy_(&src);
                }
            }
            Ok(())
        })?;
        self.steps = steps;
        self.recount();
        Ok(())
    }
}

/// One tensor's AdamW state.
pub struct Moments {
    pub exp_avg: Tensor,
    pub exp_avg_sq: Tensor,
    /// The optimizer step at which these moments started (bias correction counts from it).
    pub started: i64,
    /// The average of its gradient's noise variance, where a `"union_estimate"` node keeps one.
    pub noise: Option<Tensor>,
}

/// What [`AdamW::retarget`] did.
#[derive(Debug, Default, PartialEq)]
pub struct Retarget {
    /// Tensors that kept their moments.
    pub kept: usize,
    /// Tensors that started fresh moments.
    pub fresh: Vec<String>,
    /// Tensors no longer trained, whose moments were dropped.
    pub dropped: Vec<String>,
}

/// Learning rate at step `s` (0-based): linear warm-up from `floor·peak` to `peak`, then cosine
/// down to `floor·peak` at `t_max` (0: `max_steps`), flat after.
pub fn lr_at(s: u64, cfg: &TrainConfig) -> f64 {
    let (peak, floor) = (cfg.node_lr(), cfg.lr_floor * cfg.node_lr());
    if s < cfg.warmup_steps {
        return floor + (peak - floor) * s as f64 / cfg.warmup_steps as f64;
    }
    let end = if cfg.t_max == 0 {
        cfg.max_steps
    } else {
        cfg.t_max
    };
    let span = end.saturating_sub(cfg.warmup_steps).max(1);
    let progress = ((s - cfg.warmup_steps) as f64 / span as f64).min(1.0);
    floor + (peak - floor) * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos())
}

#[cfg(test)]
mod tests {
    use super::*;

    const FLOAT: (Kind, tch::Device) = (Kind::Float, tch::Device::Cpu);

    #[test]
    fn schedule_edges() {
        let cfg = TrainConfig {
            lr: 1.0,
            warmup_steps: 10,
            max_steps: 110,
            lr_floor: 0.1,
            ..TrainConfig::default()
        };
        assert!((lr_at(0, &cfg) - 0.1).abs() < 1e-12);
        assert!((lr_at(5, &cfg) - 0.55).abs() < 1e-12);
        assert!((lr_at(10, &cfg) - 1.0).abs() < 1e-12);
        assert!((lr_at(60, &cfg) - 0.55).abs() < 1e-12);
        assert!((lr_at(110, &cfg) - 0.1).abs() < 1e-12);
        assert!((lr_at(500, &cfg) - 0.1).abs() < 1e-12);
        // t_max shorter than the run: the floor from t_max on.
        let short = TrainConfig {
            t_max: 60,
            ..cfg.clone()
        };
        assert!((lr_at(35, &short) - 0.55).abs() < 1e-12);
        assert!((lr_at(60, &short) - 0.1).abs() < 1e-12);
        assert!((lr_at(100, &short) - 0.1).abs() < 1e-12);
        // t_max longer than the run: the run ends halfway down the same curve.
        let long = TrainConfig {
            t_max: 210,
            ..cfg.clone()
        };
        assert!((lr_at(110, &long) - 0.55).abs() < 1e-12);
        assert_eq!(lr_at(10, &long), lr_at(10, &cfg));
    }

    /// Two AdamW steps on a quadratic, checked against the closed-form PyTorch update.
    #[test]
    fn matches_the_adamw_formula() {
        let w = Tensor::from_slice(&[1.0f32, -2.0]).set_requires_grad(true);
        let p = Param {
            name: "w".into(),
            role: Role::Shared,
            tensor: w.shallow_clone(),
        };
        let cfg = TrainConfig {
            weight_decay: 0.1,
            ..TrainConfig::default()
        };
        let mut opt = AdamW::new(vec![p], &cfg);
        let (lr, b1, b2, eps, wd) = (0.01, 0.9, 0.95, 1e-8, 0.1);
        let mut expect = [1.0f64, -2.0];
        let (mut m, mut v) = ([0.0f64; 2], [0.0f64; 2]);
        for t in 1..=2 {
            opt.zero_grad().unwrap();
            (&w * &w).sum(Kind::Float).backward();
            opt.step(lr).unwrap();
            for i in 0..2 {
                let g = 2.0 * expect[i];
                expect[i] *= 1.0 - lr * wd;
                m[i] = b1 * m[i] + (1.0 - b1) * g;
                v[i] = b2 * v[i] + (1.0 - b2) * g * g;
                let mh = m[i] / (1.0 - b1.powi(t));
                let vh = v[i] / (1.0 - b2.powi(t));
                expect[i] -= lr * mh / (vh.sqrt() + eps);
            }
        }
        let got = Vec::<f64>::try_from(&w.to_kind(Kind::Double)).unwrap();
        for i in 0..2 {
            assert!((got[i] - expect[i]).abs() < 1e-6, "{got:?} vs {expect:?}");
        }
        assert_eq!(opt.state_bytes(), 2 * 2 * 4);
    }

    /// With `expert_lr_scale`, expert matrices take the step of an AdamW at the scaled rate and
    /// shared tensors that of the unscaled one.
    #[test]
    fn experts_step_at_their_own_learning_rate() {
        let make = |role: Role| Param {
            name: format!("{role:?}"),
            role,
            tensor: Tensor::from_slice(&[1.0f32, -2.0]).set_requires_grad(true),
        };
        let run = |scale: f64, roles: &[Role]| -> Vec<Vec<f64>> {
            let params: Vec<Param> = roles.iter().map(|&r| make(r)).collect();
            let ws: Vec<Tensor> = params.iter().map(|p| p.tensor.shallow_clone()).collect();
            let cfg = TrainConfig {
                expert_lr_scale: scale,
                ..TrainConfig::default()
            };
            let mut opt = AdamW::new(params, &cfg);
            for _ in 0..3 {
                opt.zero_grad().unwrap();
                let loss: Tensor = ws.iter().map(|w| (w * w).sum(Kind::Float)).sum();
                loss.backward();
                opt.step(0.01).unwrap();
            }
            ws.iter()
                .map(|w| Vec::<f64>::try_from(&w.to_kind(Kind::Double)).unwrap())
                .collect()
        };
        let expert = Role::Expert { layer: 0, index: 1 };
        let mixed = run(0.25, &[Role::Shared, expert]);
        let shared_alone = run(1.0, &[Role::Shared]);
        // An expert at scale 1 with lr 0.01 · 0.25 behaves as a shared tensor at lr 0.0025.
        let expert_alone = {
            let params = vec![make(Role::Shared)];
            let w = params[0].tensor.shallow_clone();
            let mut opt = AdamW::new(params, &TrainConfig::default());
            for _ in 0..3 {
                opt.zero_grad().unwrap();
                (&w * &w).sum(Kind::Float).backward();
                opt.step(0.0025).unwrap();
            }
            Vec::<f64>::try_from(&w.to_kind(Kind::Double)).unwrap()
        };
        assert_eq!(mixed[0], shared_alone[0]);
        assert_eq!(mixed[1], expert_alone);
        assert_ne!(mixed[1], mixed[0]);
    }

    #[test]
    fn clipping_scales_to_the_max_norm() {
        let w = Tensor::from_slice(&[3.0f32, 4.0]).set_requires_grad(true);
        let p = Param {
            name: "w".into(),
            role: Role::Shared,
            tensor: w.shallow_clone(),
        };
        let opt = AdamW::new(vec![p], &TrainConfig::default());
        (&w * &w).sum(Kind::Float).backward(); // grad = (6, 8), norm 10
        let norm = opt.clip_grad_norm(1.0).unwrap().double_value(&[]);
        assert!((norm - 10.0).abs() < 1e-5);
        let g = Vec::<f64>::try_from(&w.grad().to_kind(Kind::Double)).unwrap();
        assert!(
            (g[0] - 0.6).abs() < 1e-5 && (g[1] - 0.8).abs() < 1e-5,
            "{g:?}"
        );
    }

    /// The per-tensor AdamW formula spes ran before the fused kernel (~10 kernels a tensor):
    /// kept as the reference the fused path must match.
    struct ReferenceAdamW {
        w: Vec<Tensor>,
        m: Vec<Tensor>,
        v: Vec<Tensor>,
        started: Vec<i64>,
        steps: i64,
    }

    impl ReferenceAdamW {
        fn step(&mut self, grads: &[Tensor], lr: f64, cfg: &TrainConfig) {
            self.steps += 1;
            let tensors = self.w.iter_mut().zip(&mut self.m).zip(&mut self.v);
            for ((((w, m), v), started), g) in tensors.zip(&self.started).zip(grads) {
                let t = (self.steps - started) as i32;
                let bc1 = 1.0 - cfg.beta1.powi(t);
                let bc2_sqrt = (1.0 - cfg.beta2.powi(t)).sqrt();
                let _ = w.g_mul_scalar_(1.0 - lr * cfg.weight_decay);
                let _ = m.lerp_(g, 1.0 - cfg.beta1);
                let _ = v.g_mul_scalar_(cfg.beta2);
                let _ = v.addcmul_(g, &g.g_mul_scalar(1.0 - cfg.beta2));
                let denom = (v.sqrt() / bc2_sqrt).g_add_scalar(cfg.eps);
                let _ = w.addcdiv_(&(&*m * (-lr / bc1)), &denom);
            }
        }
    }

    /// 20 steps of the fused optimizer with clipping, a varying learning rate, weight decay and
    /// one tensor adopted at step 7 (its own bias-correction clock) stay within 1e-6 of the
    /// reference loop, and the clipping norm within 1e-6 relative of the old stacked-norm one.
    #[test]
    fn fused_matches_the_reference_loop() {
        tch::manual_seed(3);
        let cfg = TrainConfig {
            weight_decay: 0.1,
            ..TrainConfig::default()
        };
        let shapes: [&[i64]; 4] = [&[64, 32], &[32], &[7, 5, 3], &[1000]];
        let init: Vec<Tensor> = shapes.iter().map(|s| Tensor::randn(*s, FLOAT)).collect();
        let weights: Vec<Tensor> = init
            .iter()
            .map(|t| t.copy().set_requires_grad(true))
            .collect();
        let param = |i: usize| Param {
            name: format!("p{i}"),
            role: Role::Shared,
            tensor: weights[i].shallow_clone(),
        };
        let mut opt = AdamW::new((0..3).map(param).collect(), &cfg);
        let mut reference = ReferenceAdamW {
            w: init[..3].iter().map(Tensor::copy).collect(),
            m: init[..3].iter().map(Tensor::zeros_like).collect(),
            v: init[..3].iter().map(Tensor::zeros_like).collect(),
            started: vec![0; 3],
            steps: 0,
        };
        for step in 0..20 {
            if step == 7 {
                opt.retarget((0..4).map(param).collect());
                reference.w.push(init[3].copy());
                reference.m.push(init[3].zeros_like());
                reference.v.push(init[3].zeros_like());
                reference.started.push(reference.steps);
            }
            let n = reference.w.len();
            let targets: Vec<Tensor> = (0..n).map(|i| Tensor::randn(shapes[i], FLOAT)).collect();
            opt.zero_grad().unwrap();
            let loss: Tensor = (0..n)
                .map(|i| (&weights[i] * &targets[i]).sum(Kind::Float) * (1 + step) as f64)
                .sum();
            loss.backward();
            let grads: Vec<Tensor> = (0..n).map(|i| weights[i].grad().copy()).collect();
            let norms: Vec<Tensor> = grads.iter().map(Tensor::norm).collect();
            let total = Tensor::stack(&norms, 0).norm();
            let coef = (1f64 / (&total + 1e-6)).clamp_max(1.0);
            let clipped: Vec<Tensor> = grads.iter().map(|g| g * &coef).collect();
            let got = opt.clip_grad_norm(1.0).unwrap();
            let rel = (got.double_value(&[]) / total.double_value(&[]) - 1.0).abs();
            assert!(rel < 1e-6, "step {step}: norm {got:?} vs {total:?}");
            let lr = 0.01 * (1.0 + (step as f64 * 0.3).cos()) / 2.0 + 1e-3;
            opt.step(lr).unwrap();
            tch::no_grad(|| reference.step(&clipped, lr, &cfg));
            for (i, (w, r)) in weights.iter().zip(&reference.w).enumerate() {
                let diff = (w - r).abs().max().double_value(&[]);
                assert!(diff < 1e-6, "step {step}, tensor {i}: differs by {diff}");
            }
        }
        for (name, t) in opt.state() {
            if let Some(i) = name.strip_prefix("exp_avg.p") {
                let i: usize = i.parse().unwrap();
                let diff = (&t - &reference.m[i]).abs().max().double_value(&[]);
                assert!(diff < 1e-6, "{name} differs by {diff}");
            }
        }
    }

    fn param(name: &str, values: &[f32]) -> (Param, Tensor) {
        let w = Tensor::from_slice(values).set_requires_grad(true);
        let p = Param {
            name: name.into(),
            role: Role::Shared,
            tensor: w.shallow_clone(),
        };
        (p, w)
    }

    /// A node adopts tensor `c` and releases `a`: `b` keeps its moments, `c` starts fresh with
    /// its own bias correction (its first step equals a brand-new optimizer's first step), `a`
    /// loses its state; the checkpointed state round-trips that.
    #[test]
    fn retarget_keeps_moments_and_starts_adopted_tensors_fresh() {
        let cfg = TrainConfig::default();
        let (pa, a) = param("a", &[1.0, 2.0]);
        let (pb, b) = param("b", &[3.0]);
        let (pc, c) = param("c", &[0.5, -0.5]);
        let loss = |ts: &[&Tensor]| {
            let total: Tensor = ts.iter().map(|t| (*t * *t).sum(Kind::Float)).sum();
            total.backward();
        };
        let mut opt = AdamW::new(vec![pa, pb], &cfg);
        for _ in 0..3 {
            opt.zero_grad().unwrap();
            loss(&[&a, &b]);
            opt.step(0.01).unwrap();
        }
        let b_moments: Vec<Tensor> = opt.state()[2..4].iter().map(|(_, t)| t.copy()).collect();
        let r = opt.retarget(vec![
            Param {
                name: "b".into(),
                role: Role::Shared,
                tensor: b.shallow_clone(),
            },
            pc,
        ]);
        assert_eq!(
            r,
            Retarget {
                kept: 1,
                fresh: vec!["c".into()],
                dropped: vec!["a".into()]
            }
        );
        let state = opt.state();
        assert!(state[0].1.equal(&b_moments[0]) && state[1].1.equal(&b_moments[1]));
        assert_eq!(state[4].0, "started.c");
        assert_eq!(state[4].1.int64_value(&[]), 3);
        assert_eq!(opt.param_names().collect::<Vec<_>>(), vec!["b", "c"]);

        let (pf, fresh) = param("c", &[0.5, -0.5]);
        let mut reference = AdamW::new(vec![pf], &cfg);
        for o in [&mut opt, &mut reference] {
            o.zero_grad().unwrap();
        }
        loss(&[&b, &c]);
        opt.step(0.01).unwrap();
        loss(&[&fresh]);
        reference.step(0.01).unwrap();
        assert!(c.equal(&fresh), "{c:?} vs {fresh:?}");

        let (pb2, _) = param("b", &[0.0]);
        let (pc2, _) = param("c", &[0.0, 0.0]);
        let mut back = AdamW::new(vec![pb2, pc2], &cfg);
        back.load_state(opt.state(), opt.steps, "test").unwrap();
        assert_eq!(back.started, vec![0, 3]);
    }

    /// The noise average is optimizer state: saved with the moments, it resumes the same steps.
    #[test]
    fn the_noise_average_is_saved_and_resumed() {
        let cfg = TrainConfig::default();
        let make = || {
            let (p, w) = param("w", &[1.0, -2.0, 0.5]);
            (AdamW::new(vec![p], &cfg), w)
        };
        let step = |opt: &mut AdamW, w: &Tensor, k: f64| {
            opt.zero_grad().unwrap();
            (w * w * k).sum(Kind::Float).backward();
            let noise = HashMap::from([("w".to_string(), w.grad().square() * 0.5)]);
            opt.step_with_noise(1e-2, &noise, 4).unwrap();
        };
        let (mut a, wa) = make();
        step(&mut a, &wa, 1.0);
        assert_eq!(a.state_bytes(), 3 * 3 * 4, "m, v and the noise average");
        let (mut b, mut wb) = make();
        tch::no_grad(|| wb.copy_(&wa));
        b.load_state(a.state(), a.steps, "a's state").unwrap();
        for k in [2.0, 3.0] {
            step(&mut a, &wa, k);
            step(&mut b, &wb, k);
        }
        assert_eq!(
            Vec::<f32>::try_from(&wa).unwrap(),
            Vec::<f32>::try_from(&wb).unwrap()
        );
    }
}
