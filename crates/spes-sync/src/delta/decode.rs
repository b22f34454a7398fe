//! The one place wire tensors turn back into deltas, for the server's uploads and the node's
//! published rounds alike: parts paired by name and checked against the form table.

use super::form::Form;
use super::lowrank::LowRank;
use super::names::{split_wire_name, WirePart};
use super::quantized::Quantized;
use super::sparse::Sparse;
use super::{Delta, Deltas};
use crate::config::{SyncConfig, Wire};
use crate::named::Named;
use std::collections::HashMap;
use tch::{Kind, Tensor};

/// The deltas a payload of `cfg.wire` carries, each checked: tensors the layout of `shape_of`
/// knows, each once, the kind and shape of its wire form; compressed parts grouped (`name#…`)
/// with their sizes, sparse indices unique and in range, scales not negative. Says what is
/// wrong otherwise. The one place that turns wire tensors back into deltas, for the server's
/// uploads and the node's published rounds alike.
pub fn decode<'a>(
    named: Named,
    cfg: &SyncConfig,
    round: u64,
    shape_of: impl Fn(&str) -> Option<&'a [i64]>,
) -> Result<Deltas, String> {
    let parts = Form::parts_of(cfg.wire());
    let mut order: Vec<String> = Vec::new();
    let mut whole: HashMap<String, Delta> = HashMap::new();
    let mut split: HashMap<String, [Option<Tensor>; 4]> = HashMap::new();
    for (wire, t) in named {
        let part = split_wire_name(&wire).filter(|(_, p)| parts.contains(p));
        let name = part.map_or(wire.as_str(), |(n, _)| n).to_owned();
        let shape = shape_of(&name).ok_or_else(|| format!("holds unknown tensor `{name}`"))?;
        let numel: i64 = shape.iter().product();
        if whole.contains_key(&name) {
            return Err(format!("holds tensor `{name}` twice"));
        }
        let Some((_, part)) = part else {
            if split.contains_key(&name) {
                return Err(format!("holds tensor `{name}` both whole and in parts"));
            }
            if t.size() != shape {
                return Err(format!(
                    "tensor `{name}` has shape {:?}, expected {shape:?}",
                    t.size()
                ));
            }
            let d = match (cfg.wire(), t.kind()) {
                (Wire::Fp32, Kind::Float | Kind::BFloat16) => Delta::Value(t),
                (Wire::Fp32, k) => {
                    return Err(format!("tensor `{name}` is {k:?}, expected f32 or bf16"))
                }
                (_, Kind::BFloat16) => Delta::Dense(t),
                (_, k) => {
                    return Err(format!(
                        "tensor `{name}` is {k:?}, expected a bf16 delta (sync.wire = {:?})",
                        cfg.wire()
                    ))
                }
            };
            order.push(name.clone());
            whole.insert(name, d);
            continue;
        };
        if Form::of(cfg, shape, round, false).parts(numel).is_empty() {
            return Err(format!(
                "holds `{wire}`, but `{name}` (shape {shape:?}) travels whole in bf16"
            ));
        }
        let slot = split.entry(name.clone()).or_insert_with(|| {
            order.push(name);
            [None, None, None, None]
        });
        let at = parts
            .iter()
            .position(|p| *p == part)
            .expect("a part of this wire");
        if slot[at].replace(t).is_some() {
            return Err(format!("holds tensor `{wire}` twice"));
        }
    }
    order
        .into_iter()
        .map(|name| {
            if let Some(d) = whole.remove(&name) {
                return Ok((name, d));
            }
            let slot = split.remove(&name).expect("every name has a slot");
            let got: Option<Vec<Tensor>> = slot.into_iter().take(parts.len()).collect();
            let Some(got) = got else {
                let list: Vec<String> = parts.iter().map(|p| p.name("")).collect();
                return Err(format!(
                    "tensor `{name}` lacks one of its {} parts ({:?})",
                    list.join(", "),
                    cfg.wire()
                ));
            };
            let shape = shape_of(&name).expect("checked");
            let d =
                from_parts(cfg, round, shape, got).map_err(|e| format!("tensor `{name}`: {e}"))?;
            Ok((name, d))
        })
        .collect()
}

/// The delta of a tensor of `shape` from its wire parts ([`Form::parts_of`] order), checked
/// against its form's table row, then by its codec (sparse indices, scales not negative).
fn from_parts(
    cfg: &SyncConfig,
    round: u64,
    shape: &[i64],
    parts: Vec<Tensor>,
) -> Result<Delta, String> {
    let form = Form::of(cfg, shape, round, false);
    let want = form.parts(shape.iter().product());
    let fits = want
        .iter()
        .zip(&parts)
        .all(|((_, len, kind), t)| t.kind() == *kind && t.size() == [*len]);
    if !fits || want.len() != parts.len() {
        let want: Vec<String> = want
            .iter()
            .map(|&(part, len, kind)| format!("{len} {} {}", kind_name(kind), part_noun(part)))
            .collect();
        let got: Vec<String> = parts
            .iter()
            .map(|t| format!("{:?} {}", t.size(), kind_name(t.kind())))
            .collect();
        return Err(format!(
            "expected {} ({}), got {}",
            and_list(&want),
            form.describe(),
            and_list(&got)
        ));
    }
    let mut parts = parts.into_iter();
    let mut next = || parts.next().expect("as many parts as the form lists");
    let negative = |scale: &Tensor| scale.numel() > 0 && scale.min().double_value(&[]) < 0.0;
    match form {
        Form::Whole(_) => unreachable!("split tensors have parts"),
        Form::Sparse(c) => {
            let (idx, codes, scale) = (next(), next(), next());
            let s = Sparse::new(idx, codes, scale, c);
            s.check()?;
            Ok(Delta::Sparse(s))
        }
        // A negative scale would let one code mean two values; a NaN shows in the norm.
        Form::Quantized { bits, stride } => {
            let (codes, scale) = (next(), next());
            if negative(&scale) {
                return Err("has a negative scale".into());
            }
            Ok(Delta::Quantized(Quantized {
                codes,
                scale,
                bits,
                stride,
            }))
        }
        Form::LowRank(f) => {
            let (codes, scale) = (next(), next());
            if negative(&scale) {
                return Err("has a negative scale".into());
            }
            Ok(Delta::LowRank(LowRank::from_parts(codes, scale, f)))
        }
    }
}

/// `a`, `a and b`, `a, b and c`.
fn and_list(items: &[String]) -> String {
    match items {
        [] => String::new(),
        [one] => one.clone(),
        [rest @ .., last] => format!("{} and {last}", rest.join(", ")),
    }
}

/// What a part holds, in an error.
fn part_noun(part: WirePart) -> &'static str {
    match part {
        WirePart::Idx => "indices",
        WirePart::Codes => "codes",
        WirePart::Scale => "scales",
        WirePart::Handover => "handed-over values",
    }
}

/// A kind as the wire-format docs name it.
fn kind_name(kind: Kind) -> String {
    match kind {
        Kind::Uint8 => "uint8".into(),
        Kind::Int16 => "int16".into(),
        Kind::BFloat16 => "bf16".into(),
        Kind::Float => "f32".into(),
        other => format!("{other:?}"),
    }
}
