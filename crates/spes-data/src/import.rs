//! `spes data import`: a manifest over token files other tools wrote, so a corpus tokenized
//! once is never tokenized again. Reads NumPy `.npy` (header sniffed by its magic), headerless
//! memmaps (OLMo's, named `.npy` or not; dtype given) and Megatron-LM `.bin` + `.idx` pairs. The
//! files stay where they are; the manifest checksums them, and the last file's tail is held
//! out for validation.

use crate::shard::{
    self, hash_file, parse_npy_header, write_atomic, FileLayout, Manifest, ShardInfo, TokenDtype,
};
use crate::tokenize::find_eos;
use anyhow::{bail, Context, Result};
use std::io::Read;
use std::path::{Path, PathBuf};
use tokenizers::Tokenizer;

/// Options of `spes data import`.
#[derive(Clone, Debug)]
pub struct ImportOptions {
    /// Token files, in stream order.
    pub inputs: Vec<PathBuf>,
    pub out: PathBuf,
    /// The `tokenizer.json` the tokens were made with.
    pub tokenizer: PathBuf,
    pub eos_token: Option<String>,
    /// Element type of headerless files (NumPy and Megatron files carry their own).
    pub dtype: Option<TokenDtype>,
    /// Tokens held out for validation from the end of the last file.
    pub val_tokens: u64,
}

/// One input as found on disk.
struct Found {
    path: PathBuf,
    dtype: TokenDtype,
    tokens: u64,
    layout: FileLayout,
}

/// Writes `<out>/manifest.json` and `<out>/tokenizer.json` over the inputs.
pub fn import(opts: &ImportOptions) -> Result<Manifest> {
    if opts.inputs.is_empty() {
        bail!("spes data import: no input token file");
    }
    let found: Vec<Found> = opts
        .inputs
        .iter()
        .map(|p| inspect(p, opts.dtype))
        .collect::<Result<_>>()?;
    let dtype = found[0].dtype;
    if let Some(f) = found.iter().find(|f| f.dtype != dtype) {
        bail!(
            "{} holds {:?} tokens but {} holds {dtype:?}; one manifest needs one dtype",
            f.path.display(),
            f.dtype,
            found[0].path.display()
        );
    }
    let last = found.last().expect("not empty");
    if opts.val_tokens >= last.tokens {
        bail!(
            "--val-tokens {} must be fewer than the last file's {} tokens ({})",
            opts.val_tokens,
            last.tokens,
            last.path.display()
        );
    }
    std::fs::create_dir_all(&opts.out)
        .with_context(|| format!("cannot create {}", opts.out.display()))?;
    let tokenizer = Tokenizer::from_file(&opts.tokenizer)
        .map_err(|e| anyhow::anyhow!("cannot load tokenizer {}: {e}", opts.tokenizer.display()))?;
    let eos_id = find_eos(&tokenizer, opts.eos_token.as_deref())?;
    let vocab_size = crate::tokenize::vocab_size(&tokenizer);
    if dtype == TokenDtype::Uint16 && TokenDtype::for_vocab(vocab_size) != TokenDtype::Uint16 {
        bail!("the tokenizer has {vocab_size} tokens, more than uint16 token files can hold");
    }
    let json = std::fs::read(&opts.tokenizer)
        .with_context(|| format!("cannot read {}", opts.tokenizer.display()))?;
    let tokenizer_path = opts.out.join(shard::TOKENIZER);
    write_atomic(&tokenizer_path, &json)?;

    let mut train = Vec::new();
    let mut val = Vec::new();
    for (i, f) in found.iter().enumerate() {
        let abs = std::fs::canonicalize(&f.path)
            .with_context(|| format!("cannot resolve {}", f.path.display()))?;
        let info = |first: u64, tokens: u64| -> Result<ShardInfo> {
            Ok(ShardInfo {
                file: abs.display().to_string(),
                tokens,
                xxh3: hash_file(&abs)?,
                layout: f.layout,
                first,
            })
        };
        let held = if i + 1 == found.len() {
            opts.val_tokens
        } else {
            0
        };
        train.push(info(0, f.tokens - held)?);
        if held > 0 {
            val.push(info(f.tokens - held, held)?);
        }
    }
    // Document boundaries are not counted: the tokens stream as they are.
    let manifest = Manifest::over(
        &opts.out,
        &shard::Vocab {
            vocab_size,
            eos_id,
            dtype,
        },
        train,
        val,
        found.iter().map(|f| f.path.display().to_string()).collect(),
    )?;
    manifest.save(&opts.out)?;
    Ok(manifest)
}

/// The layout, dtype and length of one token file.
fn inspect(path: &Path, dtype: Option<TokenDtype>) -> Result<Found> {
    let name = path.display();
    let size = path
        .metadata()
        .with_context(|| format!("cannot read {name}"))?
        .len();
    let idx = path.with_extension("idx");
    if path.extension().is_some_and(|e| e == "bin") && idx.is_file() {
        let (dtype, tokens) = megatron_index(&idx)?;
        if tokens.checked_mul(dtype.size() as u64) != Some(size) {
            bail!(
                "{name}: its index {} lists {tokens} {dtype:?} tokens but the file is {size} bytes",
                idx.display()
            );
        }
        return Ok(Found {
            path: path.to_owned(),
            dtype,
            tokens,
            layout: FileLayout::Raw,
        });
    }
    let mut head = vec![0u8; 4096];
    let n = std::fs::File::open(path)
        .and_then(|mut f| f.read(&mut head))
        .with_context(|| format!("cannot read {name}"))?;
    head.truncate(n);
    if head.starts_with(b"\x93NUMPY") {
        let (found, tokens, offset) =
            parse_npy_header(&head).map_err(|e| anyhow::anyhow!("{name}: {e}"))?;
        let fits = tokens
            .checked_mul(found.size() as u64)
            .and_then(|b| b.checked_add(offset));
        if fits != Some(size) {
            bail!("{name}: its header says {tokens} tokens but the file is {size} bytes");
        }
        if let Some(d) = dtype.filter(|d| *d != found) {
            bail!("{name}: a NumPy file of {found:?} tokens, not the --dtype {d:?} given");
        }
        return Ok(Found {
            path: path.to_owned(),
            dtype: found,
            tokens,
            layout: FileLayout::Npy,
        });
    }
    let Some(dtype) = dtype else {
        bail!(
            "{name} has no NumPy header and no Megatron .idx beside it: a headerless token file; \
             give its element type with --dtype (uint16, uint32, int32 or int64)"
        );
    };
    if size % dtype.size() as u64 != 0 {
        bail!("{name}: {size} bytes is not a whole number of {dtype:?} tokens; is --dtype right?");
    }
    Ok(Found {
        path: path.to_owned(),
        dtype,
        tokens: size / dtype.size() as u64,
        layout: FileLayout::Raw,
    })
}

/// Magic of Megatron-LM's `MMapIndexedDataset` index.
const MEGATRON_MAGIC: &[u8; 9] = b"MMIDIDX\x00\x00";

/// The dtype and total tokens of a Megatron-LM `.idx`: magic, version 1, dtype code, sequence
/// count, document count, then the sequence lengths (int32).
fn megatron_index(idx: &Path) -> Result<(TokenDtype, u64)> {
    let name = idx.display();
    let bytes = std::fs::read(idx).with_context(|| format!("cannot read {name}"))?;
    if bytes.len() < 34 || &bytes[..9] != MEGATRON_MAGIC {
        bail!("{name}: not a Megatron-LM index (no MMIDIDX magic)");
    }
    let u64_at = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"));
    if u64_at(9) != 1 {
        bail!(
            "{name}: Megatron index version {} is not supported (expected 1)",
            u64_at(9)
        );
    }
    let dtype = match bytes[17] {
        4 => TokenDtype::Int32,
        5 => TokenDtype::Int64,
        8 => TokenDtype::Uint16,
        code => bail!(
            "{name}: Megatron dtype code {code} is not a token dtype spes reads (4 int32, 5 int64, 8 uint16)"
        ),
    };
    let sequences = u64_at(18);
    let sizes = usize::try_from(sequences)
        .ok()
        .and_then(|n| n.checked_mul(4))
        .and_then(|n| bytes.get(34..34usize.checked_add(n)?))
        .with_context(|| format!("{name}: truncated: {sequences} sequence lengths expected"))?;
    let mut tokens = 0u64;
    for b in sizes.chunks_exact(4) {
        let n = i32::from_le_bytes(b.try_into().expect("4 bytes"));
        let n = u64::try_from(n)
            .with_context(|| format!("{name}: a negative sequence length ({n})"))?;
        tokens += n;
    }
    Ok((dtype, tokens))
}

/// Writes a Megatron-LM `.bin` + `.idx` pair holding `docs` (one sequence per document), for
/// tests and for handing spes corpora to Megatron tools.
pub fn write_megatron(prefix: &Path, docs: &[Vec<u16>]) -> Result<()> {
    let mut bin = Vec::new();
    for d in docs {
        d.iter()
            .for_each(|t| bin.extend_from_slice(&t.to_le_bytes()));
    }
    let mut idx = MEGATRON_MAGIC.to_vec();
    idx.extend_from_slice(&1u64.to_le_bytes());
    idx.push(8);
    idx.extend_from_slice(&(docs.len() as u64).to_le_bytes());
    idx.extend_from_slice(&(docs.len() as u64 + 1).to_le_bytes());
    docs.iter()
        .for_each(|d| idx.extend_from_slice(&(d.len() as i32).to_le_bytes()));
    let mut pointer = 0i64;
    for d in docs {
        idx.extend_from_slice(&pointer.to_le_bytes());
        pointer += 2 * d.len() as i64;
    }
    (0..=docs.len() as i64).for_each(|i| idx.extend_from_slice(&i.to_le_bytes()));
    write_atomic(&prefix.with_extension("bin"), &bin)?;
    write_atomic(&prefix.with_extension("idx"), &idx)
}
