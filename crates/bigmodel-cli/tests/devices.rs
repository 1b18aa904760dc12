//! `bigmodel devices` on this machine: it must run, exit 0 and tell the
//! truth about CUDA (compiled in or not, driver found or not).

use std::process::Command;

fn devices(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_bigmodel"))
        .arg("devices")
        .args(args)
        .output()
        .expect("run bigmodel")
}

#[test]
fn json_reports_cuda_gpus_and_host_memory() {
    let out = devices(&["--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON document");
    let compiled = v["cuda_compiled"].as_bool().unwrap();
    assert_eq!(compiled, cfg!(feature = "cuda"));
    let driver = v["cuda_driver_found"].as_bool().unwrap();
    let gpus = v["gpus"].as_array().unwrap();
    if !compiled {
        assert!(!driver);
        assert_eq!(v["cuda_error"], "built without CUDA support");
    } else if !driver {
        let error = v["cuda_error"].as_str().unwrap();
        assert!(
            error.starts_with("no CUDA driver found: looked for"),
            "{error}"
        );
    }
    // Every library says where it was loaded from, or why it was not.
    let libraries = v["cuda_libraries"].as_object().unwrap();
    let keys: Vec<&str> = libraries.keys().map(String::as_str).collect();
    assert_eq!(keys, ["driver", "nvrtc", "cublaslt", "cublas"]);
    for (name, l) in libraries {
        assert_eq!(
            l["path"].is_string(),
            l["error"].is_null(),
            "{name}: a path or an error: {l}"
        );
        if !driver {
            assert!(l["error"].is_string(), "{name}: {l}");
        }
    }
    if !driver {
        assert!(gpus.is_empty());
    }
    for g in gpus {
        assert_eq!(g["kind"], "cuda");
        assert!(g["free_bytes"].as_u64().unwrap() <= g["total_bytes"].as_u64().unwrap());
        assert!(!g["name"].as_str().unwrap().is_empty());
    }
    assert!(v["cpu_available_bytes"].as_u64().unwrap() > 0);
    assert!(v["default_budgets"]["cpu"].as_u64().is_some());
    // The limit the host's margin scales with holds what is available.
    assert!(v["cpu_limit_bytes"].as_u64().unwrap() >= v["cpu_available_bytes"].as_u64().unwrap());
}

#[test]
fn table_says_what_was_found() {
    let out = devices(&[]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("CUDA support:"), "{text}");
    assert!(text.contains("CPU RAM available:"), "{text}");
    if !cfg!(feature = "cuda") {
        assert!(text.contains("built without CUDA support"), "{text}");
    }
}
