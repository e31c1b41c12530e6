//! What `gradwire inspect` prints: one row per tensor and totals, as a table or as JSON.

use std::fmt::Write as _;
use std::path::Path;

use crate::TensorSpec;
use crate::container::{CONTAINER_VERSION, ContainerHeader};
use crate::layout::bundle::ENTRY_HEADER_LEN;
use crate::reference;
use gradwire_core::peek;

use super::CliError;

/// One tensor of a compressed file.
#[derive(Clone, Debug)]
pub struct Row {
    /// Tensor name.
    pub name: String,
    /// Shape, when the file or the given model says it.
    pub shape: Option<Vec<usize>>,
    /// How the tensor was compressed.
    pub method: String,
    /// Element count, when known.
    pub n: Option<u64>,
    /// Entries carried (the element count for dense methods).
    pub kept: u64,
    /// Bytes of the tensor's part of the file.
    pub bytes: u64,
}

/// Everything `inspect` reports about a file.
#[derive(Clone, Debug)]
pub struct Report {
    /// `gradwire` or `reference`.
    pub layout: &'static str,
    /// File-level facts (`method`, `seed`, `step`, `mode`, ...), in print order.
    pub facts: Vec<(&'static str, String)>,
    /// One row per tensor, in file order.
    pub rows: Vec<Row>,
    /// Length of the whole file in bytes (headers, names, checksums included).
    pub file_bytes: u64,
}

/// Bits per element and the ratio to dense f32 (how many times smaller), when `n > 0`.
fn rates(n: Option<u64>, bytes: u64) -> (Option<f64>, Option<f64>) {
    match n {
        Some(n) if n > 0 => {
            let bits = bytes as f64 * 8.0 / n as f64;
            let ratio = if bytes > 0 {
                Some(4.0 * n as f64 / bytes as f64)
            } else {
                None
            };
            (Some(bits), ratio)
        }
        _ => (None, None),
    }
}

fn shape_text(shape: &Option<Vec<usize>>) -> String {
    match shape {
        Some(s) if s.is_empty() => "[]".to_owned(),
        Some(s) => s
            .iter()
            .map(|d| d.to_string())
            .collect::<Vec<_>>()
            .join("x"),
        None => "?".to_owned(),
    }
}

fn opt_num(x: Option<f64>, digits: usize) -> String {
    x.map_or_else(|| "-".to_owned(), |v| format!("{v:.digits$}"))
}

/// `s` for a terminal: every control character (`char::is_control`: C0, DEL and C1, so ESC,
/// `\n`, `\r`, BEL, backspace and CSI among them) written as `\u{..}` with its code point in
/// hex, so that a tensor name or an error message can neither break a line nor move the cursor,
/// recolour or retitle the terminal.
pub fn escape(s: &str) -> std::borrow::Cow<'_, str> {
    if !s.chars().any(char::is_control) {
        return std::borrow::Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        if c.is_control() {
            let _ = write!(out, "\\u{{{:x}}}", c as u32);
        } else {
            out.push(c);
        }
    }
    std::borrow::Cow::Owned(out)
}

/// A JSON string: `"`, `\` and every control character (`char::is_control`, DEL and C1
/// included, which JSON would allow raw) escaped.
fn json_str(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c.is_control() => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn json_f64(x: Option<f64>) -> String {
    match x {
        Some(v) if v.is_finite() => format!("{v}"),
        _ => "null".to_owned(),
    }
}

fn json_u64(x: Option<u64>) -> String {
    x.map_or_else(|| "null".to_owned(), |v| v.to_string())
}

impl Report {
    /// Total element count, when every row's is known.
    fn total_n(&self) -> Option<u64> {
        self.rows
            .iter()
            .try_fold(0u64, |acc, r| r.n.map(|n| acc.saturating_add(n)))
    }

    fn total_kept(&self) -> u64 {
        self.rows
            .iter()
            .fold(0u64, |acc, r| acc.saturating_add(r.kept))
    }

    /// A plain-text table.
    pub fn to_text(&self) -> String {
        let mut s = String::new();
        let facts: Vec<String> = self
            .facts
            .iter()
            .map(|(k, v)| format!("{k}: {}", escape(v)))
            .collect();
        let _ = writeln!(s, "layout: {}; {}", self.layout, facts.join("; "));
        let n = self.total_n();
        let (bits, ratio) = rates(n, self.file_bytes);
        let mut lines: Vec<[String; 8]> = vec![[
            "tensor".to_owned(),
            "shape".to_owned(),
            "method".to_owned(),
            "n".to_owned(),
            "kept".to_owned(),
            "bytes".to_owned(),
            "bits/elem".to_owned(),
            "ratio".to_owned(),
        ]];
        for r in &self.rows {
            let (bits, ratio) = rates(r.n, r.bytes);
            lines.push([
                escape(&r.name).into_owned(),
                shape_text(&r.shape),
                escape(&r.method).into_owned(),
                r.n.map_or_else(|| "?".to_owned(), |n| n.to_string()),
                r.kept.to_string(),
                r.bytes.to_string(),
                opt_num(bits, 3),
                opt_num(ratio, 1),
            ]);
        }
        lines.push([
            "total (whole file)".to_owned(),
            String::new(),
            String::new(),
            n.map_or_else(|| "?".to_owned(), |n| n.to_string()),
            self.total_kept().to_string(),
            self.file_bytes.to_string(),
            opt_num(bits, 3),
            opt_num(ratio, 1),
        ]);
        let mut widths = [0usize; 8];
        for l in &lines {
            for (w, c) in widths.iter_mut().zip(l) {
                *w = (*w).max(c.chars().count());
            }
        }
        for l in &lines {
            let mut line = String::new();
            for (i, (c, &w)) in l.iter().zip(&widths).enumerate() {
                if i > 0 {
                    line.push_str("  ");
                }
                // Name and method left-aligned, numbers and shapes right-aligned.
                if i == 0 || i == 2 {
                    let _ = write!(line, "{c:<w$}");
                } else {
                    let _ = write!(line, "{c:>w$}");
                }
            }
            let _ = writeln!(s, "{}", line.trim_end());
        }
        s
    }

    /// One JSON object: `layout`, the facts, `tensors` (one object per row) and `totals`
    /// (`n`, `kept`, `bytes` of the whole file, `bits_per_element`, `ratio`).
    pub fn to_json(&self) -> String {
        let mut s = String::from("{");
        let _ = write!(s, "\"layout\":{}", json_str(self.layout));
        for (k, v) in &self.facts {
            // Counts are numbers; everything else is a string.
            let value = match v.parse::<u64>() {
                Ok(x) => x.to_string(),
                Err(_) => json_str(v),
            };
            let _ = write!(s, ",{}:{value}", json_str(k));
        }
        s.push_str(",\"tensors\":[");
        for (i, r) in self.rows.iter().enumerate() {
            if i > 0 {
                s.push(',');
            }
            let (bits, ratio) = rates(r.n, r.bytes);
            let shape = match &r.shape {
                Some(sh) => {
                    format!(
                        "[{}]",
                        sh.iter()
                            .map(|d| d.to_string())
                            .collect::<Vec<_>>()
                            .join(",")
                    )
                }
                None => "null".to_owned(),
            };
            let _ = write!(
                s,
                "{{\"name\":{},\"shape\":{shape},\"method\":{},\"n\":{},\"kept\":{},\"bytes\":{},\
                 \"bits_per_element\":{},\"ratio\":{}}}",
                json_str(&r.name),
                json_str(&r.method),
                json_u64(r.n),
                r.kept,
                r.bytes,
                json_f64(bits),
                json_f64(ratio),
            );
        }
        let n = self.total_n();
        let (bits, ratio) = rates(n, self.file_bytes);
        let _ = write!(
            s,
            "],\"totals\":{{\"tensors\":{},\"n\":{},\"kept\":{},\"bytes\":{},\
             \"bits_per_element\":{},\"ratio\":{}}}}}",
            self.rows.len(),
            json_u64(n),
            self.total_kept(),
            self.file_bytes,
            json_f64(bits),
            json_f64(ratio),
        );
        s.push('\n');
        s
    }
}

/// The report of a reference payload; `specs` (the model) supplies element counts and shapes
/// of top-k tensors, and when given the payload is also fully validated against it.
pub fn reference(
    path: &Path,
    bytes: &[u8],
    specs: Option<&[TensorSpec]>,
) -> Result<Report, CliError> {
    let at = |e: reference::ReferenceError| CliError::new(format!("{}: {e}", path.display()));
    let (mode, list) = reference::summarize(bytes).map_err(at)?;
    if let Some(specs) = specs {
        reference::parse(bytes, mode, specs).map_err(at)?;
    }
    let rows = list
        .into_iter()
        .map(|s| {
            let spec = specs.and_then(|sp| sp.iter().find(|x| x.name == s.name));
            let shape = s.shape.clone().or_else(|| spec.map(|x| x.shape.clone()));
            let n = shape
                .as_ref()
                .map(|sh| sh.iter().fold(1u64, |a, &d| a.saturating_mul(d as u64)));
            Row {
                name: s.name,
                shape,
                method: mode.as_str().to_owned(),
                n,
                kept: s.kept as u64,
                bytes: s.data_bytes as u64,
            }
        })
        .collect();
    Ok(Report {
        layout: "reference",
        facts: vec![("mode", mode.as_str().to_owned())],
        rows,
        file_bytes: bytes.len() as u64,
    })
}

/// The `inspect` report of a container: every frame is checked (headers, checksums, element
/// counts, parameters) but not decoded.
pub fn container(path: &Path, bytes: &[u8], max_elements: u64) -> Result<Report, CliError> {
    let at = |e: crate::Error| CliError::from(e).in_file(path);
    let header = ContainerHeader::read_for(bytes, None, max_elements).map_err(at)?;
    let manifest = header.manifest().map_err(at)?;
    let bundle = &bytes[header.bundle_offset..];
    let mut rows = Vec::with_capacity(manifest.entries().len());
    let bh = manifest
        .check_bundle_with(bundle, None, None, |e, frame, _| {
            let entry = &manifest.entries()[e];
            let h = peek(frame).map_err(|source| crate::Error::Core {
                tensor: entry.label.clone(),
                rank: None,
                source,
            })?;
            for &m in &entry.members {
                let t = &manifest.tensors()[m];
                rows.push(Row {
                    name: t.name.clone(),
                    shape: Some(t.shape.clone()),
                    method: crate::method::format(&h.params.method),
                    n: Some(t.numel as u64),
                    kept: h.kept,
                    bytes: (frame.len() + ENTRY_HEADER_LEN) as u64,
                });
            }
            Ok(())
        })
        .map_err(at)?;
    Ok(Report {
        layout: "gradwire",
        facts: vec![
            ("method", crate::method::format(&header.method)),
            ("seed", header.seed.to_string()),
            ("step", bh.step.to_string()),
            ("container_version", CONTAINER_VERSION.to_string()),
            ("bundle_version", bh.version.to_string()),
            ("manifest_bytes", header.bundle_offset.to_string()),
            ("bundle_bytes", bundle.len().to_string()),
        ],
        rows,
        file_bytes: bytes.len() as u64,
    })
}
