//! Our quantization against bitsandbytes' own, bit for bit: the fixtures
//! (tools/make_bnb_fixtures.py) hold what bitsandbytes 0.50 made on the CPU
//! from weights both sides compute from one integer formula, in
//! transformers' safetensors key layout.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use bm_compute::quant::{Entry, FourBitType, QuantFormat, QuantizedTensor, quantize};
use bm_compute::{HostBytes, Tensor};
use bm_tensor::{DType, HostBuffer, TensorMeta};
use safetensors::SafeTensors;
use serde_json::Value;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/bnb")
}

/// The fixture script's `weight()`, in the same float64 arithmetic.
fn weight(rows: usize, cols: usize, seed: u64) -> Vec<f32> {
    (0..(rows * cols) as u64)
        .map(|i| {
            let h = (i * 2_654_435_761 + seed * 40503 + 12345) % (1 << 32);
            let mut v = h as f64 / 4_294_967_296.0 - 0.5;
            v *= [0.02, 1.0, 3.0, 0.5][((i / 192) % 4) as usize];
            if i % 97 == 0 {
                v *= 8.0;
            }
            if (128..192).contains(&i) {
                v = 0.0;
            }
            v as f32
        })
        .collect()
}

struct Case {
    name: String,
    rows: usize,
    cols: usize,
    dtype: DType,
    format: QuantFormat,
    seed: u64,
    dequant: bool,
}

fn cases() -> Vec<Case> {
    let text = std::fs::read_to_string(fixtures().join("cases.json")).unwrap();
    let cases: Vec<Value> = serde_json::from_str(&text).unwrap();
    cases
        .iter()
        .map(|c| {
            let s = |k: &str| c[k].as_str().unwrap().to_string();
            let n = |k: &str| c[k].as_u64().unwrap() as usize;
            let format = match s("format").as_str() {
                "int8" => QuantFormat::Int8 { threshold: 6.0 },
                kind => QuantFormat::FourBit {
                    kind: FourBitType::from_name(kind).unwrap(),
                    blocksize: n("blocksize"),
                    double_quant: c["double_quant"].as_bool().unwrap(),
                },
            };
            Case {
                name: s("name"),
                rows: n("rows"),
                cols: n("cols"),
                dtype: match s("dtype").as_str() {
                    "float32" => DType::F32,
                    "float16" => DType::F16,
                    _ => DType::BF16,
                },
                format,
                seed: n("seed") as u64,
                dequant: c["dequant"].as_bool().unwrap(),
            }
        })
        .collect()
}

fn dtype_of(d: safetensors::Dtype) -> DType {
    match d {
        safetensors::Dtype::U8 => DType::U8,
        safetensors::Dtype::I8 => DType::I8,
        safetensors::Dtype::F32 => DType::F32,
        other => panic!("unexpected fixture dtype {other:?}"),
    }
}

/// The fixture's entries whose key starts with `prefix`.
fn entries(file: &SafeTensors<'_>, prefix: &str) -> HashMap<String, Entry> {
    file.tensors()
        .into_iter()
        .filter(|(k, _)| k.starts_with(prefix) && !k.ends_with(".dequant"))
        .map(|(k, t)| {
            let meta = TensorMeta::new(dtype_of(t.dtype()), t.shape().to_vec());
            let bytes = HostBytes::Owned(HostBuffer::from_bytes(t.data()).unwrap());
            (k, Entry { meta, bytes })
        })
        .collect()
}

#[test]
fn quantized_parts_equal_bitsandbytes_bit_for_bit() {
    let bytes = std::fs::read(fixtures().join("formats.safetensors")).unwrap();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    let cases = cases();
    assert!(cases.len() >= 10);
    for case in &cases {
        let values = weight(case.rows, case.cols, case.seed);
        let w = Tensor::from_f32(case.dtype, &[case.rows, case.cols], &values).unwrap();
        let key = format!("{}.weight", case.name);
        let ours = quantize(&w, case.format, &key).unwrap();
        let theirs = entries(&file, &format!("{}.", case.name));
        let ours_entries = ours.to_entries(&key);
        let mut names: Vec<&str> = ours_entries.iter().map(|e| e.name.as_str()).collect();
        let mut want: Vec<&str> = theirs.keys().map(String::as_str).collect();
        names.sort();
        want.sort();
        assert_eq!(names, want, "{}: keys", case.name);

        // Double quantization's offset is a float32 mean, which PyTorch sums
        // in a machine-dependent order and we in f64 (docs/compat.md); on
        // these fixtures the two agree, so every byte must too.
        for e in &ours_entries {
            let t = &theirs[&e.name];
            assert_eq!(e.meta, t.meta, "{}", e.name);
            assert!(
                e.bytes.as_ref() == t.bytes.as_bytes(),
                "{}: bytes differ",
                e.name
            );
        }
    }
}

#[test]
fn dequantizing_bitsandbytes_state_equals_its_dequantization() {
    let bytes = std::fs::read(fixtures().join("formats.safetensors")).unwrap();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    let mut checked = 0;
    for case in cases().iter().filter(|c| c.dequant) {
        let key = format!("{}.weight", case.name);
        let mut theirs = entries(&file, &format!("{}.", case.name));
        let q = QuantizedTensor::from_entries(&key, &mut theirs, None, 6.0)
            .unwrap()
            .unwrap();
        assert!(
            theirs.is_empty(),
            "{}: unused {:?}",
            case.name,
            theirs.keys()
        );
        // bitsandbytes dequantizes 4-bit to the weight's dtype, 8-bit to f32.
        let dtype = match case.format {
            QuantFormat::FourBit { .. } => case.dtype,
            QuantFormat::Int8 { .. } => DType::F32,
        };
        let ours = q.dequantize(dtype).unwrap().to_f32_vec();
        let want: Vec<f32> = file
            .tensor(&format!("{}.dequant", case.name))
            .unwrap()
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        // `==`: bitsandbytes' C++ FP4 table has -0.0 where its Python table
        // has +0.0; every other value is bit-identical.
        for (i, (a, b)) in ours.iter().zip(&want).enumerate() {
            assert!(a == b, "{} [{i}]: {a} vs {b}", case.name);
        }
        assert_eq!(ours.len(), want.len());
        checked += 1;
    }
    assert!(checked >= 8);
}

#[test]
fn written_entries_read_back_unchanged() {
    let values = weight(9, 70, 3);
    let w = Tensor::from_f32(DType::BF16, &[9, 70], &values).unwrap();
    for format in [
        QuantFormat::FourBit {
            kind: FourBitType::Fp4,
            blocksize: 32,
            double_quant: true,
        },
        QuantFormat::Int8 { threshold: 6.0 },
    ] {
        let q = quantize(&w, format, "m.weight").unwrap();
        let mut entries: HashMap<String, Entry> = q
            .to_entries("m.weight")
            .into_iter()
            .map(|e| {
                let bytes = HostBytes::Owned(HostBuffer::from_bytes(&e.bytes).unwrap());
                (
                    e.name,
                    Entry {
                        meta: e.meta,
                        bytes,
                    },
                )
            })
            .collect();
        let back = QuantizedTensor::from_entries("m.weight", &mut entries, None, 6.0)
            .unwrap()
            .unwrap();
        assert!(entries.is_empty());
        assert_eq!(back.format(), q.format());
        assert_eq!(back.dtype(), q.dtype());
        assert_eq!(
            back.dequantize(DType::F32).unwrap().to_f32_vec(),
            q.dequantize(DType::F32).unwrap().to_f32_vec()
        );
        assert_eq!(back.byte_len(), format.byte_len(9, 70));
    }
}
