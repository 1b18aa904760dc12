//! A corpus of hostile and careless inputs across the CLI's commands (issue
//! 10's acceptance), generated here into a temporary folder: broken and
//! oversized headers, indexes and folders that lead elsewhere, absurd
//! config values and flags, device maps naming nothing, usage mistakes.
//! Every case must end within a minute with a one-paragraph error on
//! stderr that names what failed (or succeed where that is right), and
//! never with a panic, an abort or a signal.

mod common;

use std::process::Command;

use common::hostile::{Case, Expect, edited_copy, err, failures, os, write};
use common::{fixture, tiny_llama, write_raw_safetensors};
use serde_json::{Value, json};

#[test]
fn hostile_inputs_across_every_command_are_clear_errors() {
    let root = tempfile::tempdir().unwrap();
    let d = root.path();
    let llama = tiny_llama();
    let llama_config = llama.join("config.json");
    let p = |name: &str| d.join(name);

    // Checkpoints.
    let empty = write(&p("empty.safetensors"), b"");
    let huge_len = write(&p("huge-len.safetensors"), u64::MAX.to_le_bytes());
    let list = p("list.safetensors");
    write_raw_safetensors(&list, "[]", &[]);
    let not_utf8 = p("not-utf8.safetensors");
    write_raw_safetensors(&not_utf8, "{\"\u{1}\":1}", &[]);
    std::fs::write(&not_utf8, {
        let mut b = std::fs::read(&not_utf8).unwrap();
        b[10] = 0xff;
        b
    })
    .unwrap();
    let nul_name = p("nul-name.safetensors");
    write_raw_safetensors(
        &nul_name,
        r#"{"a\u0000b":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}"#,
        &[1],
    );
    let absurd_shape = p("absurd-shape.safetensors");
    write_raw_safetensors(
        &absurd_shape,
        r#"{"w":{"dtype":"F32","shape":[4294967296,4294967296,4],"data_offsets":[0,4]}}"#,
        &[0; 4],
    );
    let escaping = p("escaping");
    std::fs::create_dir(&escaping).unwrap();
    write(
        &escaping.join("model.safetensors.index.json"),
        json!({"weight_map": {"w": "../empty.safetensors"}}).to_string(),
    );
    let absolute = p("absolute");
    std::fs::create_dir(&absolute).unwrap();
    write(
        &absolute.join("model.safetensors.index.json"),
        json!({"weight_map": {"w": "/etc/passwd"}}).to_string(),
    );
    let folder_as_file = p("folder-as-file");
    std::fs::create_dir_all(folder_as_file.join("model.safetensors")).unwrap();
    let bad_bin = write(&p("pytorch_model.bin"), b"PK\x03\x04 not really a zip");

    // Configs and maps.
    let config = |name: &str, edit: &dyn Fn(&mut Value)| {
        let mut c: Value =
            serde_json::from_str(&std::fs::read_to_string(&llama_config).unwrap()).unwrap();
        edit(&mut c);
        write(&p(name), c.to_string())
    };
    let layers_1e12 = config("layers-1e12.json", &|c| {
        c["num_hidden_layers"] = json!(1_000_000_000_000u64)
    });
    let hidden_text = config("hidden-text.json", &|c| c["hidden_size"] = json!("64"));
    let vocab_negative = config("vocab-negative.json", &|c| c["vocab_size"] = json!(-1));
    let config_list = write(&p("config-list.json"), "[1, 2]");
    let unknown_key_map = write(
        &p("unknown-key-map.json"),
        json!({"": "cpu", "foo.bar": "cpu"}).to_string(),
    );
    let misspelt_map = write(
        &p("misspelt-map.json"),
        json!({"model.layer": "cpu", "model.embed_tokens": "cpu", "model.norm": "cpu", "lm_head": "cpu"})
            .to_string(),
    );
    let map_not_json = write(&p("map-not-json.json"), "{\"\": ");
    let tree_garbage = write(
        &p("tree.json"),
        json!({"format": "module-tree/1", "root": {"class": 7}}).to_string(),
    );
    // Models whose config disagrees with the checkpoint's layers.
    let llama_9000 = edited_copy(&llama, &p("llama-9000"), |c| {
        c["num_hidden_layers"] = json!(9000)
    });
    let llama_1 = edited_copy(&llama, &p("llama-1"), |c| c["num_hidden_layers"] = json!(1));
    let gpt2 = fixture("tiny-gpt2");
    // T5 folders: no decoder start, a feed-forward not run, a config whose
    // sizes disagree with the tensors, more decoder blocks than stored.
    let t5 = fixture("tiny-t5");
    let t5_no_start = edited_copy(&t5, &p("t5-no-start"), |c| {
        c.as_object_mut().unwrap().remove("decoder_start_token_id");
    });
    std::fs::remove_file(t5_no_start.join("generation_config.json")).unwrap();
    let t5_swiglu = edited_copy(&t5, &p("t5-swiglu"), |c| {
        c["feed_forward_proj"] = json!("gated-quick_gelu")
    });
    let t5_d_ff = edited_copy(&t5, &p("t5-d-ff"), |c| c["d_ff"] = json!(40));
    let t5_3_decoder = edited_copy(&t5, &p("t5-3-decoder"), |c| {
        c["num_decoder_layers"] = json!(3)
    });
    let not_a_folder = write(&p("offload-is-a-file"), b"x");
    let disk_map = write(&p("disk-map.json"), json!({"": "disk"}).to_string());
    // Opening a FIFO for reading waits for a writer: it must be refused.
    let fifo = p("fifo.json");
    assert!(
        Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap()
            .success()
    );

    // A model folder whose config.json is a FIFO: `run --verify` plans
    // from the config before anything else reads it.
    let fifo_config = edited_copy(&llama, &p("fifo-config"), |_| {});
    std::fs::remove_file(fifo_config.join("config.json")).unwrap();
    assert!(
        Command::new("mkfifo")
            .arg(fifo_config.join("config.json"))
            .status()
            .unwrap()
            .success()
    );

    let usize_max = usize::MAX.to_string();
    let u64_over = "99999999999999999999999";
    let two_55 = (1u64 << 55).to_string();
    let two_56 = (1u64 << 56).to_string();
    let out = p("out");

    let cases = vec![
        // inspect
        Case {
            name: "an empty file",
            args: os(&[&"inspect", &empty]),
            expect: err(&["empty.safetensors", "too short"]),
        },
        Case {
            name: "a header length of 2^64-1",
            args: os(&[&"inspect", &huge_len]),
            expect: err(&["huge-len.safetensors", "header length"]),
        },
        Case {
            name: "a header that is a list",
            args: os(&[&"inspect", &list]),
            expect: err(&["list.safetensors"]),
        },
        Case {
            name: "a header that is not UTF-8",
            args: os(&[&"inspect", &not_utf8]),
            expect: err(&["not-utf8.safetensors", "UTF-8"]),
        },
        Case {
            name: "a name holding NUL, kept as the file has it",
            args: os(&[&"inspect", &nul_name, &"--json"]),
            expect: Expect::Ok,
        },
        Case {
            name: "a shape of 2^66 elements",
            args: os(&[&"inspect", &absurd_shape]),
            expect: err(&["absurd-shape.safetensors", "tensor \"w\""]),
        },
        Case {
            name: "an index naming a shard outside its folder",
            args: os(&[&"inspect", &escaping]),
            expect: err(&["model.safetensors.index.json", "..", "../empty.safetensors"]),
        },
        Case {
            name: "an index naming an absolute path",
            args: os(&[&"inspect", &absolute]),
            expect: err(&["model.safetensors.index.json", "/etc/passwd"]),
        },
        Case {
            name: "model.safetensors that is a folder",
            args: os(&[&"inspect", &folder_as_file]),
            expect: err(&["model.safetensors", "folder"]),
        },
        Case {
            name: "a path that does not exist",
            args: os(&[&"inspect", &p("nothing-here")]),
            expect: err(&["nothing-here"]),
        },
        Case {
            name: "a .bin that is not a zip",
            args: os(&[&"inspect", &bad_bin]),
            expect: err(&["pytorch_model.bin"]),
        },
        // convert and shard
        Case {
            name: "convert of a .bin that is not a zip",
            args: os(&[&"convert", &bad_bin, &out]),
            expect: err(&["pytorch_model.bin"]),
        },
        Case {
            name: "shard into a spelling of the input folder",
            args: os(&[
                &"shard",
                &llama,
                &llama.join("."),
                &"--max-shard-size",
                &"1KB",
            ]),
            expect: err(&["holds the checkpoint being read"]),
        },
        Case {
            name: "shard with a size of 2^64 bytes",
            args: os(&[
                &"shard",
                &llama,
                &out,
                &"--max-shard-size",
                &"18446744073709551616",
            ]),
            expect: err(&["--max-shard-size"]),
        },
        // plan
        Case {
            name: "num_hidden_layers of 10^12",
            args: os(&[&"plan", &layers_1e12]),
            expect: err(&[
                "layers-1e12.json",
                "num_hidden_layers",
                "more than the 10000 allowed",
            ]),
        },
        Case {
            name: "hidden_size given as text",
            args: os(&[&"plan", &hidden_text]),
            expect: err(&["hidden-text.json", "hidden_size"]),
        },
        Case {
            name: "a negative vocab_size",
            args: os(&[&"plan", &vocab_negative]),
            expect: err(&["vocab-negative.json", "vocab_size"]),
        },
        Case {
            name: "a config that is a list",
            args: os(&[&"plan", &config_list]),
            expect: err(&["config-list.json"]),
        },
        Case {
            name: "a module tree of the wrong shape",
            args: os(&[&"plan", &tree_garbage]),
            expect: err(&["tree.json"]),
        },
        Case {
            name: "--max-seq-len 2^55",
            args: os(&[
                &"plan",
                &llama_config,
                &"--max-memory",
                &"0=1GB,cpu=1GB",
                &"--max-seq-len",
                &two_55,
            ]),
            expect: err(&["streaming reserve on 0", "more than 2^64 bytes"]),
        },
        Case {
            name: "--max-seq-len 2^56",
            args: os(&[
                &"plan",
                &llama_config,
                &"--max-memory",
                &"0=1GB,cpu=1GB",
                &"--max-seq-len",
                &two_56,
            ]),
            expect: err(&["streaming reserve on 0", "more than 2^64 bytes"]),
        },
        Case {
            name: "--batch-size 2^64-1",
            args: os(&[
                &"plan",
                &llama_config,
                &"--max-memory",
                &"0=1GB,cpu=1GB",
                &"--max-seq-len",
                &"8",
                &"--batch-size",
                &usize_max,
            ]),
            expect: err(&["streaming reserve on 0"]),
        },
        Case {
            name: "--prefetch-depth 2^64-1 plans as deep as there are layers",
            args: os(&[
                &"plan",
                &llama_config,
                &"--max-memory",
                &"0=400KB,cpu=1GB",
                &"--prefetch-depth",
                &usize_max,
            ]),
            expect: Expect::Ok,
        },
        Case {
            name: "a device map naming nothing in the model",
            args: os(&[&"plan", &llama_config, &"--device-map", &unknown_key_map]),
            expect: err(&[
                "unknown-key-map.json",
                "\"foo.bar\" (closest: \"model\", \"lm_head\")",
            ]),
        },
        Case {
            name: "a device map with a misspelt module",
            args: os(&[&"plan", &llama_config, &"--device-map", &misspelt_map]),
            expect: err(&["\"model.layer\" (closest: \"model.layers\""]),
        },
        Case {
            name: "a device map that is cut short",
            args: os(&[&"plan", &llama_config, &"--device-map", &map_not_json]),
            expect: err(&["map-not-json.json"]),
        },
        Case {
            name: "a device map that is a FIFO",
            args: os(&[&"plan", &llama_config, &"--device-map", &fifo]),
            expect: err(&["fifo.json", "FIFO"]),
        },
        Case {
            name: "a config that is a FIFO",
            args: os(&[&"plan", &fifo]),
            expect: err(&["fifo.json", "FIFO"]),
        },
        Case {
            name: "run with a device map that is a FIFO",
            args: os(&[
                &"run",
                &llama,
                &"--prompt-ids",
                &"1",
                &"--device-map",
                &fifo,
            ]),
            expect: err(&["fifo.json", "FIFO"]),
        },
        Case {
            name: "run --verify on a folder whose config.json is a FIFO",
            args: os(&[&"run", &fifo_config, &"--prompt-ids", &"1", &"--verify"]),
            expect: err(&["config.json", "FIFO"]),
        },
        Case {
            name: "--max-memory with an empty size",
            args: os(&[&"plan", &llama_config, &"--max-memory", &"0="]),
            expect: err(&["for 0"]),
        },
        Case {
            name: "--max-memory with an empty device key",
            args: os(&[&"plan", &llama_config, &"--max-memory", &"=1GB"]),
            expect: err(&["--max-memory \"=1GB\"", "not recognized"]),
        },
        Case {
            name: "--max-memory of an Apple GPU",
            args: os(&[&"plan", &llama_config, &"--max-memory", &"mps=1GB"]),
            expect: err(&["mps (Apple Metal) is not supported"]),
        },
        Case {
            name: "--reserve of a device without a budget",
            args: os(&[
                &"plan",
                &llama_config,
                &"--max-memory",
                &"cpu=1GB",
                &"--reserve",
                &"3=1GB",
            ]),
            expect: err(&["--reserve 3"]),
        },
        // run and embed
        Case {
            name: "a config with 9000 layers over a checkpoint of 3",
            args: os(&[&"run", &llama_9000, &"--prompt-ids", &"1"]),
            expect: err(&["config.json", "num_hidden_layers", "9000", "holds 3"]),
        },
        Case {
            name: "a config with 1 layer over a checkpoint of 3",
            args: os(&[&"run", &llama_1, &"--prompt-ids", &"1"]),
            expect: err(&["config.json", "num_hidden_layers", "model.layers.1."]),
        },
        Case {
            name: "a T5 config without decoder_start_token_id",
            args: os(&[&"run", &t5_no_start, &"--prompt-ids", &"5,6"]),
            expect: err(&["config.json", "decoder_start_token_id", "missing"]),
        },
        Case {
            name: "a T5 feed-forward activation not implemented",
            args: os(&[&"run", &t5_swiglu, &"--prompt-ids", &"5,6"]),
            expect: err(&["config.json", "feed_forward_proj", "quick_gelu"]),
        },
        Case {
            name: "a T5 config whose d_ff disagrees with the tensors",
            args: os(&[&"run", &t5_d_ff, &"--prompt-ids", &"5,6"]),
            expect: err(&[
                "encoder.block.0.layer.1.DenseReluDense.wi_0.weight",
                "40",
                "32",
            ]),
        },
        Case {
            name: "a T5 config with 3 decoder blocks over a checkpoint of 2",
            args: os(&[&"run", &t5_3_decoder, &"--prompt-ids", &"5,6"]),
            expect: err(&["config.json", "num_decoder_layers", "decoder.block.2."]),
        },
        Case {
            name: "--max-new-tokens 2^64-1 reserves nothing up front",
            args: os(&[
                &"run",
                &gpt2,
                &"--prompt-ids",
                &"3",
                &"--max-new-tokens",
                &usize_max,
            ]),
            expect: Expect::Settled,
        },
        Case {
            name: "a token id past u32",
            args: os(&[&"run", &llama, &"--prompt-ids", &"4294967296"]),
            expect: err(&["--prompt-ids", "4294967296"]),
        },
        Case {
            name: "an offload folder that is a file",
            args: os(&[
                &"run",
                &llama,
                &"--prompt-ids",
                &"1",
                &"--device-map",
                &disk_map,
                &"--offload-folder",
                &not_a_folder,
            ]),
            expect: err(&["offload-is-a-file"]),
        },
        Case {
            name: "embed of a decoder folder",
            args: os(&[&"embed", &llama, &"hi"]),
            expect: err(&["llama"]),
        },
        // usage mistakes: clap's errors, as one paragraph
        Case {
            name: "a negative number",
            args: os(&[&"plan", &llama_config, &"--max-seq-len", &"-5"]),
            expect: err(&["'-5'", "try 'bigmodel plan --help'"]),
        },
        Case {
            name: "a number past 64 bits",
            args: os(&[&"run", &llama, &"--max-new-tokens", &u64_over]),
            expect: err(&["--max-new-tokens", "try 'bigmodel run --help'"]),
        },
        Case {
            name: "a flag given twice",
            args: os(&[&"inspect", &llama, &"--json", &"--json"]),
            expect: err(&["--json", "try 'bigmodel inspect --help'"]),
        },
        Case {
            name: "a missing argument",
            args: os(&[&"shard", &llama]),
            expect: err(&["required", "try 'bigmodel shard --help'"]),
        },
        Case {
            name: "an unknown flag",
            args: os(&[&"devices", &"--bogus"]),
            expect: err(&["--bogus", "try 'bigmodel devices --help'"]),
        },
        Case {
            name: "an unknown command",
            args: os(&[&"explode"]),
            expect: err(&["explode", "try 'bigmodel --help'"]),
        },
    ];
    let failures = failures(&cases);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(!out.exists(), "a failed command wrote its output");
}
