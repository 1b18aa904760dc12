//! The options of `cargo xtask bench` and its help text.

use std::path::PathBuf;

pub(super) const HELP: &str = "\
cargo xtask bench [--quick] [--with-accelerate] [--prebuilt DIR] [--only SECTIONS]

Runs the benchmark suite and writes target/bench-report.md and
target/bench-report.json: every figure next to its baseline from the same run.

  --quick            criterion --quick, smaller checkpoint and model (minutes)
  --with-accelerate  also run the Python baseline (Accelerate, transformers,
                     safetensors) from target/bench-venv, created from PyPI with
                     tools/requirements-bench.txt; BM_BENCH_PYTHON=/path/to/python
                     uses that interpreter instead of a venv
  --prebuilt DIR     run from a GPU bundle (cargo xtask gpu-bundle) without
                     cargo: DIR/bin/bigmodel, the bench binaries of DIR/benches,
                     the scripts of DIR/tools; writes under DIR/target/
  --only SECTIONS    only these sections, comma-separated: plan, checkpoint,
                     inspect, load, prediction, data-path, gpu, decode
";

/// The sections of the report, in its order (`--only` names).
pub(super) const SECTIONS: [&str; 8] = [
    "plan",
    "checkpoint",
    "inspect",
    "load",
    "prediction",
    "data-path",
    "gpu",
    "decode",
];

/// Options of `cargo xtask bench`.
#[derive(Debug, PartialEq)]
pub struct Options {
    pub(super) quick: bool,
    pub(super) with_accelerate: bool,
    /// A GPU bundle folder to run from instead of the workspace.
    pub(super) prebuilt: Option<PathBuf>,
    /// The sections to run (`--only`); `None` runs them all.
    pub(super) only: Option<Vec<String>>,
}

impl Options {
    /// Parses the arguments after `bench`; `Ok(None)` means help was printed.
    pub fn parse(args: &[String]) -> Result<Option<Self>, String> {
        let mut options = Options {
            quick: false,
            with_accelerate: false,
            prebuilt: None,
            only: None,
        };
        let mut args = args.iter();
        while let Some(arg) = args.next() {
            let only = match arg.as_str() {
                "--only" => Some(args.next().map(String::as_str).unwrap_or("")),
                other => other.strip_prefix("--only="),
            };
            if let Some(list) = only {
                let sections: Vec<String> = list.split(',').map(str::to_string).collect();
                if let Some(bad) = sections.iter().find(|s| !SECTIONS.contains(&s.as_str())) {
                    return Err(format!(
                        "cargo xtask bench: --only {bad:?}: expected sections among {}\n{HELP}",
                        SECTIONS.join(", ")
                    ));
                }
                options.only = Some(sections);
                continue;
            }
            let prebuilt = match arg.as_str() {
                "--prebuilt" => Some(args.next().map(String::as_str).unwrap_or("")),
                other => other.strip_prefix("--prebuilt="),
            };
            if let Some(dir) = prebuilt {
                if dir.is_empty() || dir.starts_with("--") {
                    return Err(format!(
                        "cargo xtask bench: --prebuilt needs a bundle folder\n{HELP}"
                    ));
                }
                options.prebuilt = Some(PathBuf::from(dir));
                continue;
            }
            match arg.as_str() {
                "--quick" => options.quick = true,
                "--with-accelerate" => options.with_accelerate = true,
                "--help" | "-h" => {
                    print!("{HELP}");
                    return Ok(None);
                }
                other => {
                    return Err(format!(
                        "cargo xtask bench: unknown option {other:?}\n{HELP}"
                    ));
                }
            }
        }
        Ok(Some(options))
    }

    /// True when section `name` (one of [`SECTIONS`]) runs.
    pub(super) fn runs(&self, name: &str) -> bool {
        self.only
            .as_ref()
            .is_none_or(|only| only.iter().any(|s| s == name))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(args: &[&str]) -> Vec<String> {
        args.iter().map(|a| a.to_string()).collect()
    }

    #[test]
    fn options_parse_prebuilt_in_both_spellings() {
        let o = Options::parse(&strings(&["--prebuilt", "bundle", "--quick"]))
            .unwrap()
            .unwrap();
        assert_eq!(
            o,
            Options {
                quick: true,
                with_accelerate: false,
                prebuilt: Some(PathBuf::from("bundle")),
                only: None,
            }
        );
        let o = Options::parse(&strings(&["--with-accelerate", "--prebuilt=."]))
            .unwrap()
            .unwrap();
        assert_eq!(o.prebuilt, Some(PathBuf::from(".")));
        assert!(o.with_accelerate && !o.quick);
        let o = Options::parse(&[]).unwrap().unwrap();
        assert_eq!(o.prebuilt, None);
    }

    #[test]
    fn options_refuse_prebuilt_without_a_folder() {
        for args in [
            &["--prebuilt"][..],
            &["--prebuilt="],
            &["--prebuilt", "--quick"],
        ] {
            let e = Options::parse(&strings(args)).unwrap_err();
            assert!(
                e.contains("--prebuilt needs a bundle folder"),
                "{args:?}: {e}"
            );
        }
        let e = Options::parse(&strings(&["--prebuild", "x"])).unwrap_err();
        assert!(e.contains("unknown option \"--prebuild\""), "{e}");
    }

    #[test]
    fn only_names_sections() {
        let o = Options::parse(&strings(&["--only", "decode,load"]))
            .unwrap()
            .unwrap();
        assert!(o.runs("decode") && o.runs("load") && !o.runs("plan"));
        let o = Options::parse(&strings(&["--only=gpu"])).unwrap().unwrap();
        assert!(o.runs("gpu") && !o.runs("decode"));
        assert!(Options::parse(&[]).unwrap().unwrap().runs("plan"));
        for bad in [&["--only"][..], &["--only", "decoding"], &["--only=plan,"]] {
            let e = Options::parse(&strings(bad)).unwrap_err();
            assert!(e.contains("expected sections among plan"), "{bad:?}: {e}");
        }
    }
}
