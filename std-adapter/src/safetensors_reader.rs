//! The checked safetensors reader: untrusted safetensors bytes (residual checkpoints,
//! reference-layout payloads, the CLI's input files) are parsed here, never by
//! `safetensors::SafeTensors::deserialize` alone.
//!
//! safetensors 0.8 adds the data length its header declares to the header length without an
//! overflow check (a crafted header whose offsets end near `usize::MAX` panics where overflow
//! checks are on), and its header type buffers every value before typing it. [`read_header`]
//! validates the header first, with nothing added unchecked, typing each entry as it comes, so
//! that what it allocates is bounded by the header's own bytes; safetensors' `Metadata::new`
//! still checks the offsets, shapes and dtypes. It refuses what safetensors accepts silently: a
//! shape of more than 64 dimensions (before parsing), a tensor named twice (safetensors
//! keeps the last) and a field other than `dtype`, `shape` and `data_offsets` in a tensor's
//! entry.

use safetensors::SafeTensorError;
use safetensors::tensor::{Dtype, Metadata, SafeTensors, TensorInfo};
use serde::de::{self, Deserialize, Deserializer, MapAccess, Visitor};
use std::collections::HashMap;
use std::fmt;

/// The largest header safetensors 0.8 accepts (its `MAX_HEADER_SIZE`), in bytes.
pub(crate) const MAX_HEADER_LEN: usize = 100_000_000;

/// The most dimensions a tensor's shape may have (NumPy 2's `NPY_MAXDIMS` is 64 too). Any array
/// of a header longer than this is refused: a safetensors header has no other arrays than
/// shapes and offsets, although safetensors itself would accept one in an unknown field.
pub(crate) const MAX_DIMS: usize = 64;

/// The most elements of any JSON array in `header` outside strings (commas + 1 of each
/// outermost array: what a nested array or an object inside holds counts toward the outer one;
/// a safetensors header's arrays, shapes and offsets, do not nest). One pass, nothing
/// allocated.
pub(crate) fn longest_array(header: &[u8]) -> usize {
    let (mut in_string, mut escaped) = (false, false);
    let (mut depth, mut count, mut longest) = (0usize, 0usize, 0usize);
    for &b in header {
        if in_string {
            match b {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'[' => {
                if depth == 0 {
                    count = 1;
                }
                depth += 1;
            }
            b']' => depth = depth.saturating_sub(1),
            b',' if depth > 0 => count += 1,
            _ => {}
        }
        longest = longest.max(count);
    }
    longest
}

/// `e`'s message, with a hint for the errors of the first bytes (the 8-byte header length and
/// the UTF-8 header it frames), which are what a file of another kind gives.
pub fn describe(e: &SafeTensorError) -> String {
    crate::error::describe_safetensors(e)
}

/// Parses the header of safetensors `bytes` (8-byte little-endian header length, UTF-8 JSON
/// header; every tensor's dtype, shape and offsets validated by safetensors' [`Metadata`]) and
/// checks that the data section is exactly as long as the offsets say. Returns the header and
/// the data section.
///
/// # Errors
/// `HeaderTooSmall`, `HeaderTooLarge`, `InvalidHeaderLength`, `InvalidHeader` and
/// `MetadataIncompleteBuffer` for the framing defects `SafeTensors::deserialize` names so;
/// `InvalidHeaderDeserialization` for everything wrong inside the header (its message starts
/// "invalid JSON in header", safetensors' wording, although the JSON may be valid): JSON that
/// does not parse, bad offsets, shapes or dtypes (for which `SafeTensors::deserialize` gives
/// `Metadata::new`'s own error variant), and what this module refuses and safetensors accepts:
/// an array of more than 64 elements, a tensor named twice, a field other than
/// `dtype`, `shape` and `data_offsets` in a tensor's entry.
///
/// # Panics
/// Never.
pub fn read_header(bytes: &[u8]) -> Result<(Metadata, &[u8]), SafeTensorError> {
    let (len, rest) = bytes
        .split_first_chunk::<8>()
        .ok_or(SafeTensorError::HeaderTooSmall)?;
    let n =
        usize::try_from(u64::from_le_bytes(*len)).map_err(|_| SafeTensorError::HeaderTooLarge)?;
    if n > MAX_HEADER_LEN {
        return Err(SafeTensorError::HeaderTooLarge);
    }
    let (header, data) = rest
        .split_at_checked(n)
        .ok_or(SafeTensorError::InvalidHeaderLength)?;
    let meta = parse_header(header)?;
    if meta.data_len() != data.len() {
        return Err(SafeTensorError::MetadataIncompleteBuffer);
    }
    Ok((meta, data))
}

/// [`read_header`] of a safetensors file read from `file`, `file_len` bytes long, from its
/// start: reads the 8-byte header length and the header (nothing before checking that it fits
/// the file and safetensors' limit), and nothing of the data. Returns the header and the offset
/// of the data section in the file, so that a reader can then read one tensor at a time.
///
/// # Errors
/// As [`read_header`]; [`SafeTensorError::IoError`] when reading fails.
///
/// # Panics
/// Never.
pub fn read_header_from(
    file: &mut impl std::io::Read,
    file_len: u64,
) -> Result<(Metadata, u64), SafeTensorError> {
    if file_len < 8 {
        return Err(SafeTensorError::HeaderTooSmall);
    }
    let mut len = [0u8; 8];
    file.read_exact(&mut len)?;
    let n = u64::from_le_bytes(len);
    if n > MAX_HEADER_LEN as u64 {
        return Err(SafeTensorError::HeaderTooLarge);
    }
    if n > file_len - 8 {
        return Err(SafeTensorError::InvalidHeaderLength);
    }
    let mut header = vec![0u8; n as usize];
    file.read_exact(&mut header)?;
    let meta = parse_header(&header)?;
    if meta.data_len() as u64 != file_len - 8 - n {
        return Err(SafeTensorError::MetadataIncompleteBuffer);
    }
    Ok((meta, 8 + n))
}

/// The header bytes (after the 8-byte length) parsed and checked as [`read_header`] says.
fn parse_header(header: &[u8]) -> Result<Metadata, SafeTensorError> {
    let header = std::str::from_utf8(header).map_err(SafeTensorError::InvalidHeader)?;
    let longest = longest_array(header.as_bytes());
    if longest > MAX_DIMS {
        return Err(SafeTensorError::InvalidHeaderDeserialization(
            serde::de::Error::custom(format!(
                "an array of {longest} elements: a shape has at most {MAX_DIMS} dimensions"
            )),
        ));
    }
    let Header { metadata, tensors } =
        serde_json::from_str(header).map_err(SafeTensorError::InvalidHeaderDeserialization)?;
    metadata_of(metadata, tensors).map_err(SafeTensorError::InvalidHeaderDeserialization)
}

/// A safetensors header as parsed here: the `__metadata__` map and the tensors in file order.
///
/// safetensors 0.8 parses a header into a struct with a `#[serde(flatten)]` map of tensors,
/// which makes serde buffer every value of the header before it is typed: a header of 500
/// tensors of 64 zero dimensions each (91 KB) allocated 1.59 MB that way, 17 bytes per header
/// byte (`tests/alloc_bound.rs`). This visitor types each entry as it comes, so the header costs
/// its names and shapes plus a fixed amount per tensor.
struct Header {
    metadata: Option<HashMap<String, String>>,
    tensors: Vec<(String, TensorInfo)>,
}

impl<'de> Deserialize<'de> for Header {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Entries;
        impl<'de> Visitor<'de> for Entries {
            type Value = Header;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a safetensors header (a JSON object)")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Header, A::Error> {
                let mut metadata = None;
                let mut seen_metadata = false;
                let mut tensors: Vec<(String, TensorInfo)> = Vec::new();
                while let Some(name) = map.next_key::<String>()? {
                    if name == "__metadata__" {
                        if seen_metadata {
                            return Err(de::Error::duplicate_field("__metadata__"));
                        }
                        seen_metadata = true;
                        metadata = map.next_value()?;
                    } else {
                        let Entry {
                            dtype,
                            shape,
                            data_offsets,
                        } = map.next_value()?;
                        let info = TensorInfo {
                            dtype,
                            shape,
                            data_offsets,
                        };
                        tensors.push((name, info));
                    }
                }
                Ok(Header { metadata, tensors })
            }
        }
        deserializer.deserialize_map(Entries)
    }
}

/// A tensor's entry in a header: safetensors' `TensorInfo` with no other field allowed. An
/// unknown field's value would be skipped by serde_json without the checks a value gets when it
/// is read (numbers in range, valid escapes, nesting depth), where safetensors' own parse reads
/// and checks it; refusing such fields keeps every accepted header one that safetensors accepts.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Entry {
    dtype: Dtype,
    shape: Vec<usize>,
    data_offsets: (usize, usize),
}

/// safetensors' [`Metadata`] of a parsed header: tensors sorted by their offsets (as safetensors
/// does: files may list them in any order), then checked by `Metadata::new` (offsets contiguous
/// from 0, each tensor's byte length its shape times its dtype's size; its error is wrapped as
/// `impl Deserialize for Metadata` wraps it). A name given twice is an error (safetensors' own parse kept
/// the last one).
fn metadata_of(
    metadata: Option<HashMap<String, String>>,
    mut tensors: Vec<(String, TensorInfo)>,
) -> Result<Metadata, serde_json::Error> {
    let mut names: Vec<&str> = tensors.iter().map(|(n, _)| n.as_str()).collect();
    names.sort_unstable();
    if let Some(w) = names.windows(2).find(|w| w[0] == w[1]) {
        return Err(de::Error::custom(format!(
            "the header names tensor `{}` twice",
            w[0]
        )));
    }
    tensors.sort_by_key(|(_, info)| info.data_offsets);
    Metadata::new(metadata, tensors).map_err(de::Error::custom)
}

/// `SafeTensors::deserialize` of `bytes` after [`read_header`] has validated them, so that
/// safetensors' own arithmetic cannot overflow (its header length plus a data length that equals
/// the bytes present).
///
/// # Errors
/// As [`read_header`], then as `SafeTensors::deserialize`.
///
/// # Panics
/// Never.
pub fn deserialize(bytes: &[u8]) -> Result<SafeTensors<'_>, SafeTensorError> {
    read_header(bytes)?;
    SafeTensors::deserialize(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn longest_array_counts_outside_strings() {
        let h = br#"{"a\"[1,2,3,4]":{"shape":[2,3],"data_offsets":[0,24]},"__metadata__":{"k":"[,,,,]"}}"#;
        assert_eq!(longest_array(h), 2);
        assert_eq!(longest_array(br#"{"w":{"shape":[1,1,1,1,1]}}"#), 5);
        assert_eq!(longest_array(br#"{"w":{"shape":[]}}"#), 1);
        assert_eq!(longest_array(br#"{"w\\":{"shape":[1,1,1]}}"#), 3);
        let wide = format!("{{\"w\":{{\"shape\":[{}]}}}}", vec!["1"; 65].join(","));
        assert_eq!(longest_array(wide.as_bytes()), 65);
        let mut file = (wide.len() as u64).to_le_bytes().to_vec();
        file.extend_from_slice(wide.as_bytes());
        let err = read_header(&file).unwrap_err().to_string();
        assert!(err.contains("at most 64 dimensions"), "{err}");
    }

    fn file(header: &str, data: usize) -> Vec<u8> {
        let mut f = (header.len() as u64).to_le_bytes().to_vec();
        f.extend_from_slice(header.as_bytes());
        f.resize(f.len() + data, 0);
        f
    }

    /// The header parser of this module against safetensors' own, on valid and invalid headers.
    #[test]
    fn headers_parse_as_safetensors_parses_them() {
        // Header, data bytes. Tensors listed out of offset order load as safetensors sorts them.
        let valid = [
            (
                r#"{"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]},"a":{"dtype":"F32","shape":[],"data_offsets":[0,4]}}"#,
                12,
            ),
            (
                r#"{"__metadata__":{"k":"v"},"w":{"dtype":"U8","shape":[2,0],"data_offsets":[0,0]}}"#,
                0,
            ),
            (r#"{"__metadata__":null}"#, 0),
            (r#"{}"#, 0),
        ];
        for (h, data) in valid {
            let f = file(h, data);
            let (meta, _) = read_header(&f).unwrap_or_else(|e| panic!("{h}: {e}"));
            let theirs = SafeTensors::read_metadata(&f).unwrap().1;
            assert_eq!(meta.offset_keys(), theirs.offset_keys(), "{h}");
            assert_eq!(meta.metadata(), theirs.metadata(), "{h}");
            for (name, info) in theirs.tensors() {
                let ours = meta.info(&name).map(|i| format!("{i:?}"));
                assert_eq!(ours, Some(format!("{info:?}")), "{h}: {name}");
            }
            assert_eq!(meta.tensors().len(), theirs.tensors().len(), "{h}");
        }
        // Header, data bytes (what the header would need, so that only the header is wrong).
        let deep = format!(
            r#"{{"a":{{"dtype":"F32","shape":[0],"data_offsets":[0,0],"x":{}1{}}}}}"#,
            "[".repeat(130),
            "]".repeat(130)
        );
        let invalid = [
            // Offsets with a gap, a shape that does not fill them, an unknown dtype, a bad entry.
            (
                r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}"#,
                8,
            ),
            (
                r#"{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}"#,
                8,
            ),
            (
                r#"{"a":{"dtype":"F33","shape":[2],"data_offsets":[0,8]}}"#,
                8,
            ),
            (r#"{"a":{"dtype":"F32","shape":[2]}}"#, 8),
            (r#"{"__metadata__":{"k":1}}"#, 0),
            (r#"[]"#, 0),
            // Values that safetensors checks as it reads them, in a field it ignores.
            (
                r#"{"a":{"dtype":"F32","shape":[0],"data_offsets":[0,0],"x":1e400}}"#,
                0,
            ),
            (
                r#"{"a":{"dtype":"F32","shape":[0],"data_offsets":[0,0],"x":"\udc00"}}"#,
                0,
            ),
            (&deep, 0),
        ];
        for (h, data) in invalid {
            let f = file(h, data);
            let err = read_header(&f).unwrap_err();
            assert!(
                matches!(err, SafeTensorError::InvalidHeaderDeserialization(_)),
                "{h}: {err}"
            );
            assert!(SafeTensors::deserialize(&f).is_err(), "{h}");
        }
        // A field safetensors ignores is refused here, whatever its value.
        let extra = r#"{"a":{"dtype":"F32","shape":[0],"data_offsets":[0,0],"x":1}}"#;
        assert!(SafeTensors::deserialize(&file(extra, 0)).is_ok());
        let err = read_header(&file(extra, 0)).unwrap_err().to_string();
        assert!(err.contains("unknown field `x`"), "{err}");
        // A tensor named twice: safetensors keeps the last entry, this module refuses the file.
        let twice = r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#;
        let err = read_header(&file(twice, 8)).unwrap_err().to_string();
        assert!(err.contains("names tensor `a` twice"), "{err}");
        let twice_meta = r#"{"__metadata__":{},"__metadata__":{}}"#;
        assert!(read_header(&file(twice_meta, 0)).is_err());
    }
}
