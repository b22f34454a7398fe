//! AdamW over the trainable tensors only, the learning-rate schedule and gradient clipping.
//!
//! The moments are our own tensors (not tch's opaque optimizer) so they can be saved, restored
//! bit-exactly and measured. A frozen tensor is never given to the optimizer, so it has no state.

use crate::config::TrainConfig;
use anyhow::{bail, Context, Result};
use spes_model::Param;
use std::collections::HashMap;
use tch::{Kind, Tensor};

/// PyTorch-equivalent AdamW (decoupled weight decay, bias correction).
pub struct AdamW {
    params: Vec<Param>,
    exp_avg: Vec<Tensor>,
    exp_avg_sq: Vec<Tensor>,
    /// Per tensor, the value of `steps` when its moments started: 0, or the step at which a
    /// node adopted it mid-run. Bias correction counts from there, as for a fresh optimizer.
    started: Vec<i64>,
    /// Optimizer steps taken.
    pub steps: i64,
    beta1: f64,
    beta2: f64,
    eps: f64,
    weight_decay: f64,
}

impl AdamW {
    /// State for exactly these parameters, zero-initialised.
    pub fn new(params: Vec<Param>, cfg: &TrainConfig) -> Self {
        let zeros = |p: &Param| p.tensor.zeros_like().detach();
        AdamW {
            exp_avg: params.iter().map(zeros).collect(),
            exp_avg_sq: params.iter().map(zeros).collect(),
            started: vec![0; params.len()],
            params,
            steps: 0,
            beta1: cfg.beta1,
            beta2: cfg.beta2,
            eps: cfg.eps,
            weight_decay: cfg.weight_decay,
        }
    }

    /// Names of the tensors this optimizer updates.
    pub fn param_names(&self) -> impl Iterator<Item = &str> {
        self.params.iter().map(|p| p.name.as_str())
    }

    /// Bytes of optimizer state (both moments).
    pub fn state_bytes(&self) -> u64 {
        self.exp_avg
            .iter()
            .chain(&self.exp_avg_sq)
            .map(|t| (t.numel() * t.kind().elt_size_in_bytes()) as u64)
            .sum()
    }

    /// Trains exactly `params` from now on: tensors it already trained keep their moments,
    /// new ones start fresh (zero moments, bias correction from this step), and tensors no
    /// longer trained lose theirs. Used when a node's expert ownership changes.
    pub fn retarget(&mut self, params: Vec<Param>) -> Retarget {
        let mut old: HashMap<String, (Tensor, Tensor, i64)> = self
            .params
            .drain(..)
            .zip(self.exp_avg.drain(..))
            .zip(self.exp_avg_sq.drain(..))
            .zip(self.started.drain(..))
            .map(|(((p, m), v), s)| (p.name, (m, v, s)))
            .collect();
        let mut report = Retarget::default();
        for p in params {
            let (m, v, s) = match old.remove(&p.name) {
                Some(kept) => {
                    report.kept += 1;
                    kept
                }
                None => {
                    report.fresh.push(p.name.clone());
                    let z = || p.tensor.zeros_like().detach();
                    (z(), z(), self.steps)
                }
            };
            self.params.push(p);
            self.exp_avg.push(m);
            self.exp_avg_sq.push(v);
            self.started.push(s);
        }
        report.dropped = old.into_keys().collect();
        report.dropped.sort();
        report
    }

    /// One update at learning rate `lr` from the accumulated gradients.
    pub fn step(&mut self, lr: f64) {
        self.steps += 1;
        tch::no_grad(|| {
            for (((p, m), v), started) in self
                .params
                .iter()
                .zip(&mut self.exp_avg)
                .zip(&mut self.exp_avg_sq)
                .zip(&self.started)
            {
                let g = p.tensor.grad();
                if !g.defined() {
                    continue;
                }
                let t = (self.steps - started) as i32;
                let bc1 = 1.0 - self.beta1.powi(t);
                let bc2_sqrt = (1.0 - self.beta2.powi(t)).sqrt();
                let mut w = p.tensor.shallow_clone();
                let _ = w.g_mul_scalar_(1.0 - lr * self.weight_decay);
                let _ = m.lerp_(&g, 1.0 - self.beta1);
                let _ = v.g_mul_scalar_(self.beta2);
                let _ = v.addcmul_(&g, &g.g_mul_scalar(1.0 - self.beta2));
                let denom = (v.sqrt() / bc2_sqrt).g_add_scalar(self.eps);
                let _ = w.addcdiv_(&(&*m * (-lr / bc1)), &denom);
            }
        });
    }

    /// Clears gradients (sets them to zero in place, keeping their buffers).
    pub fn zero_grad(&mut self) {
        for p in &mut self.params {
            p.tensor.zero_grad();
        }
    }

    /// Scales gradients so their global L2 norm is at most `max_norm`; returns the pre-clip norm
    /// as a tensor (reading it is a host sync, so callers do it only when logging).
    pub fn clip_grad_norm(&self, max_norm: f64) -> Tensor {
        let grads: Vec<Tensor> = self
            .params
            .iter()
            .map(|p| p.tensor.grad())
            .filter(|g| g.defined())
            .collect();
        let norms: Vec<Tensor> = grads
            .iter()
            .map(|g| g.norm().to_kind(Kind::Float))
            .collect();
        let total = Tensor::stack(&norms, 0).norm();
        let coef = (max_norm / (&total + 1e-6)).clamp_max(1.0);
        tch::no_grad(|| {
            for g in &grads {
                let _ = g.shallow_clone().g_mul_(&coef);
            }
        });
        total
    }

    /// Named moments, for a checkpoint; `started.<name>` for tensors adopted mid-run.
    pub fn state(&self) -> Vec<(String, Tensor)> {
        let mut out = Vec::with_capacity(2 * self.params.len());
        for (((p, m), v), s) in self
            .params
            .iter()
            .zip(&self.exp_avg)
            .zip(&self.exp_avg_sq)
            .zip(&self.started)
        {
            out.push((format!("exp_avg.{}", p.name), m.shallow_clone()));
            out.push((format!("exp_avg_sq.{}", p.name), v.shallow_clone()));
            if *s != 0 {
                out.push((format!("started.{}", p.name), Tensor::from(*s)));
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
        for (p, s) in self.params.iter().zip(&mut self.started) {
            *s = match map.remove(&format!("started.{}", p.name)) {
                Some(t) => t.int64_value(&[]),
                None => 0,
            };
        }
        if map.len() != 2 * self.params.len() {
            bail!(
                "{source}: holds {} moment tensors, expected {} for the {} trainable tensors",
                map.len(),
                2 * self.params.len(),
                self.params.len()
            );
        }
        tch::no_grad(|| -> Result<()> {
            for ((p, m), v) in self
                .params
                .iter()
                .zip(&mut self.exp_avg)
                .zip(&mut self.exp_avg_sq)
            {
                for (prefix, dst) in [("exp_avg", m), ("exp_avg_sq", v)] {
                    let key = format!("{prefix}.{}", p.name);
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
        Ok(())
    }
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
    let (peak, floor) = (cfg.lr, cfg.lr_floor * cfg.lr);
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
    use spes_model::Role;

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
            opt.zero_grad();
            (&w * &w).sum(Kind::Float).backward();
            opt.step(lr);
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
        let norm = opt.clip_grad_norm(1.0).double_value(&[]);
        assert!((norm - 10.0).abs() < 1e-5);
        let g = Vec::<f64>::try_from(&w.grad().to_kind(Kind::Double)).unwrap();
        assert!(
            (g[0] - 0.6).abs() < 1e-5 && (g[1] - 0.8).abs() < 1e-5,
            "{g:?}"
        );
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
            opt.zero_grad();
            loss(&[&a, &b]);
            opt.step(0.01);
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
            o.zero_grad();
        }
        loss(&[&b, &c]);
        opt.step(0.01);
        loss(&[&fresh]);
        reference.step(0.01);
        assert!(c.equal(&fresh), "{c:?} vs {fresh:?}");

        let (pb2, _) = param("b", &[0.0]);
        let (pc2, _) = param("c", &[0.0, 0.0]);
        let mut back = AdamW::new(vec![pb2, pc2], &cfg);
        back.load_state(opt.state(), opt.steps, "test").unwrap();
        assert_eq!(back.started, vec![0, 3]);
    }
}
