//! Every cast between F64, F32, F16 and BF16 against what torch 2.15 computed
//! for the same inputs (special values, NaN payloads, 2000 random bit
//! patterns per dtype): `tools/make_cast_fixture.py` wrote the fixture.

use bm_tensor::{DType, cast};

const FLOATS: [DType; 4] = [DType::F64, DType::F32, DType::F16, DType::BF16];

#[test]
fn every_float_cast_is_bit_identical_to_pytorch() {
    let bytes = std::fs::read(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/casts.safetensors"
    ))
    .unwrap();
    let fixture = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut checked = 0;
    for from in FLOATS {
        let input = fixture.tensor(&format!("in.{from}")).unwrap();
        for to in FLOATS.into_iter().filter(|&t| t != from) {
            let expected = fixture.tensor(&format!("out.{from}.{to}")).unwrap();
            let ours = cast(input.data(), from, to).unwrap();
            let size = to.size_in_bytes();
            let mismatches: Vec<usize> = (0..expected.data().len() / size)
                .filter(|&i| {
                    ours.as_bytes()[i * size..(i + 1) * size]
                        != expected.data()[i * size..(i + 1) * size]
                })
                .collect();
            assert!(
                mismatches.is_empty(),
                "{from} -> {to}: {} of {} elements differ, first at index {}",
                mismatches.len(),
                expected.data().len() / size,
                mismatches[0]
            );
            checked += 1;
        }
    }
    assert_eq!(checked, 12);
}
