//! RFC 8785 (JCS) canonical JSON: the bytes a job id (and a batch id) is the hash of.
//!
//! This module owns the canonical form's writer. A value is first turned into a
//! `serde_json::Value` (its serialisation as any JSON writer sees it), then written
//! with JCS's rules: no whitespace; object members sorted by their names' UTF-16 code
//! units; strings escaped as ECMAScript's `JSON.stringify` does (`\"`, `\\`, the short
//! forms `\b \t \n \f \r`, other control characters as `\u00xx` in lowercase hex,
//! everything else as it is, which is also how serde_json escapes); every number
//! written as the ECMAScript `Number` it is as a double (`ryu-js`: `5.0` is `5`, `1e21`
//! is `1e+21`; an integer beyond 2^53 is rounded, as JCS says).
//!
//! It replaced `serde_jcs` on the hot path (three job ids a job: submit, the worker's
//! check, the projector's), which buffered and re-parsed every member name; its output
//! is checked against `serde_jcs` in the tests below.

use serde::Serialize;
use serde_json::Value;

/// The canonical JSON of `value`. Fails only where serde_json cannot represent it (a
/// map with keys that are not strings); a non-finite float, which JSON cannot carry,
/// is written as `null`, as serde_json's own `Value` holds it.
pub fn to_vec<T: Serialize + ?Sized>(value: &T) -> Result<Vec<u8>, serde_json::Error> {
    let value = serde_json::to_value(value)?;
    let mut out = Vec::with_capacity(256);
    write(&mut out, &value);
    Ok(out)
}

fn write(out: &mut Vec<u8>, value: &Value) {
    match value {
        Value::Null => out.extend_from_slice(b"null"),
        Value::Bool(true) => out.extend_from_slice(b"true"),
        Value::Bool(false) => out.extend_from_slice(b"false"),
        Value::Number(n) => {
            // Every number is the double it denotes (JCS 3.2.2.3).
            let f = match (n.as_u64(), n.as_i64()) {
                (Some(u), _) => u as f64,
                (None, Some(i)) => i as f64,
                _ => n.as_f64().unwrap_or(f64::NAN),
            };
            if f.is_finite() {
                out.extend_from_slice(ryu_js::Buffer::new().format_finite(f).as_bytes());
            } else {
                out.extend_from_slice(b"null");
            }
        }
        Value::String(s) => string(out, s),
        Value::Array(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write(out, item);
            }
            out.push(b']');
        }
        Value::Object(map) => {
            let mut members: Vec<(&String, &Value)> = map.iter().collect();
            members.sort_by(|(a, _), (b, _)| a.encode_utf16().cmp(b.encode_utf16()));
            out.push(b'{');
            for (i, (name, item)) in members.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                string(out, name);
                out.push(b':');
                write(out, item);
            }
            out.push(b'}');
        }
    }
}

/// A JSON string as JCS writes it (serde_json's escaping is the same).
fn string(out: &mut Vec<u8>, s: &str) {
    serde_json::to_writer(&mut *out, s).expect("writing to a Vec cannot fail");
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// What serde_jcs (the reference this writer replaced) makes of the same value.
    fn reference(v: &Value) -> String {
        String::from_utf8(serde_jcs::to_vec(v).unwrap()).unwrap()
    }

    fn ours(v: &Value) -> String {
        String::from_utf8(to_vec(v).unwrap()).unwrap()
    }

    #[test]
    fn the_same_bytes_as_the_reference() {
        let cases = [
            json!(null),
            json!({}),
            json!([]),
            json!({"b": 1, "a": [true, false, null], "c": {"z": "x", "y": {}}}),
            // Numbers: integers, doubles written as integers, exponents, negatives.
            json!([0, -0.0, 1, -1, 5.0, 0.25, 0.1, 1e21, 1e-7, 123456789012345680000.0, 1.5e300, -2.5e-300]),
            json!([u64::MAX, i64::MIN, 9_007_199_254_740_993u64, 4.0f32 as f64, f64::from(0.3f32)]),
            // Strings: quotes, backslashes, every control character, DEL, non-ASCII,
            // U+2028/2029, a character outside the BMP.
            json!({"s": "a\"b\\c/d\u{7f}é\u{2028}\u{2029}😀", "controls": (0u8..0x20).map(char::from).collect::<String>()}),
            // Member names ordered by UTF-16 code units, which differ from UTF-8's
            // order for characters outside the BMP against U+E000..U+FFFF.
            json!({"\u{fb01}": 1, "😀": 2, "é": 3, "e": 4, "E": 5, "": 6, "ee": 7, "\u{e000}": 8}),
        ];
        for v in cases {
            assert_eq!(ours(&v), reference(&v), "{v}");
        }
    }

    /// Not a check: prints the time of one request's canonical JSON, ours against
    /// serde_jcs (`cargo test --release -p stemq-core --lib canonical::tests::figures
    /// -- --ignored --nocapture`; `docs/benchmarks.md`, "Settings, each against its alternative").
    #[test]
    #[ignore]
    fn figures() {
        use crate::request::JobRequest;
        let n = JobRequest::from_value(json!({"audio_uri": "file:///uploads/bench/1.wav", "model": "dsp"}))
            .unwrap()
            .normalize("bench")
            .unwrap();
        const N: u32 = 200_000;
        let time = |f: &dyn Fn() -> Vec<u8>| {
            let t = std::time::Instant::now();
            for _ in 0..N {
                std::hint::black_box(f());
            }
            t.elapsed() / N
        };
        let jcs = time(&|| serde_jcs::to_vec(&n).unwrap());
        let ours = time(&|| to_vec(&n).unwrap());
        println!("canonical JSON of a request: serde_jcs {jcs:?}, request::canonical {ours:?}");
    }

    #[test]
    fn every_request_shape_gives_the_reference_bytes() {
        use crate::request::{JobRequest, ANONYMOUS};
        let bodies = [
            json!({"audio_uri": "file:///a.wav"}),
            json!({"audio_uri": "file:///a b/ü.wav", "model": "htdemucs_6s", "two_stems": "guitar"}),
            json!({"audio_uri": "s3://bucket/x.flac", "output_format": "mp3", "mp3_bitrate": 192, "mp3_preset": 7}),
            json!({"audio_uri": "file:///a.wav", "segment": 6.5, "overlap": 0.1, "shifts": 3, "clip_mode": "clamp"}),
            json!({"audio_uri": "file:///a.wav", "output_format": "flac", "encoding": "s24", "model": "mdx_extra_q"}),
        ];
        for body in bodies {
            let n = JobRequest::from_value(body.clone()).unwrap().normalize(ANONYMOUS).unwrap();
            let reference = serde_jcs::to_vec(&n).unwrap();
            assert_eq!(to_vec(&n).unwrap(), reference, "{body}");
        }
    }
}
