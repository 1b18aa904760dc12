//! An offload folder that another process rewrites while this one runs (two
//! runs sharing an `--offload-folder` with different bytes): this process
//! computes with the bytes it wrote, whether its weights are read through
//! their mapping or directly from the file on their way to a GPU.

mod common;

use std::sync::Arc;

use bm_device::{Device, DeviceSet};
use bm_dispatch::{
    DiskReads, DispatchOptions, LoadOptions, Model, dispatch_model, load_checkpoint_in_model,
};
use bm_plan::DeviceMap;
use bm_shard::Checkpoint;
use bm_tensor::DType;
use common::*;

#[test]
fn a_dat_file_replaced_by_another_process_is_never_read() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = Checkpoint::open(write_checkpoint(dir.path())).unwrap();
    let load = |folder: Option<&std::path::Path>| LoadOptions {
        dtype: Some(DType::BF16),
        offload_folder: folder.map(std::path::Path::to_path_buf),
        ..LoadOptions::default()
    };
    let in_ram = Model::empty(tree(), Arc::new(DeviceSet::cpu_only())).unwrap();
    load_checkpoint_in_model(&in_ram, &ckpt, None, &load(None)).unwrap();
    let expected = bits(&forward(&in_ram, &input()));
    let map = DeviceMap::from_json(&serde_json::json!({"": "disk"})).unwrap();
    for reads in [DiskReads::Direct, DiskReads::Cached] {
        let folder = dir.path().join(format!("offload-{reads:?}"));
        let devices = Arc::new(DeviceSet::emulated(&[1 << 30]));
        let model = Model::empty(tree(), devices).unwrap();
        load_checkpoint_in_model(&model, &ckpt, Some(&map), &load(Some(&folder))).unwrap();
        let options = DispatchOptions {
            main_device: Some(Device::Gpu(0)),
            offload_dir: Some(folder.clone()),
            disk_reads: reads,
            ..DispatchOptions::default()
        };
        dispatch_model(&model, &map, &options).unwrap();
        // Another run renames its own files (other bytes, same sizes) over
        // every `.dat` before this one reads any.
        let mut replaced = 0;
        for entry in std::fs::read_dir(&folder).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "dat") {
                let len = std::fs::metadata(&path).unwrap().len() as usize;
                bm_shard::write_atomic(&path, &vec![0x3f; len]).unwrap();
                replaced += 1;
            }
        }
        assert!(replaced > 0, "nothing was written to the folder");
        assert_eq!(bits(&forward(&model, &input())), expected, "{reads:?}");
    }
}
