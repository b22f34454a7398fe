//! The wire-name protocol: a compressed delta travels as parts named `<tensor>#<suffix>`.

/// The parts a compressed delta of one tensor travels as, each under `<tensor>#<suffix>`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WirePart {
    /// Sparse: indices within their chunk (int16).
    Idx,
    /// Packed codes (uint8); low rank: U's, then V's.
    Codes,
    /// Quantized: one bf16 scale per group; sparse: two levels per chunk; low rank: U's, then
    /// V's, one per group.
    Scale,
    /// An expert's change its previous owner had not sent when the expert passed to another
    /// node, handed over whole in bf16 in that node's next upload (not a part of a delta).
    Handover,
}

impl WirePart {
    const ALL: [WirePart; 4] = [
        WirePart::Idx,
        WirePart::Codes,
        WirePart::Scale,
        WirePart::Handover,
    ];

    fn suffix(self) -> &'static str {
        match self {
            WirePart::Idx => "#idx",
            WirePart::Codes => "#q",
            WirePart::Scale => "#scale",
            WirePart::Handover => "#handover",
        }
    }

    /// The wire name of this part of tensor `name`.
    pub fn name(self, name: &str) -> String {
        format!("{name}{}", self.suffix())
    }
}

/// The tensor a compressed delta's wire name belongs to, and which part it names.
pub fn split_wire_name(wire: &str) -> Option<(&str, WirePart)> {
    WirePart::ALL
        .into_iter()
        .find_map(|p| wire.strip_suffix(p.suffix()).map(|n| (n, p)))
}

/// The tensor a wire tensor belongs to: its name without a part suffix.
pub fn tensor_of(wire: &str) -> &str {
    split_wire_name(wire).map_or(wire, |(n, _)| n)
}
