//! The seam for dispatch: every block fetches only its own tensors, by
//! transformers' names, between its source's begin/end hooks.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use bm_models::{CausalLm, Error, FolderWeights, GenerateOptions, Tensor, WeightSource};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

#[derive(Clone, Debug, PartialEq)]
enum Event {
    Begin(String),
    Fetch(String),
    End(String),
}

/// Records every call, then defers to the folder.
struct Recording {
    inner: FolderWeights,
    events: Arc<Mutex<Vec<Event>>>,
}

impl WeightSource for Recording {
    fn tensor(&self, name: &str) -> Result<Arc<Tensor>, Error> {
        self.events
            .lock()
            .unwrap()
            .push(Event::Fetch(name.to_string()));
        self.inner.tensor(name)
    }

    fn begin_block(&self, block: &str) -> Result<(), Error> {
        self.events
            .lock()
            .unwrap()
            .push(Event::Begin(block.to_string()));
        Ok(())
    }

    fn end_block(&self, block: &str) {
        self.events
            .lock()
            .unwrap()
            .push(Event::End(block.to_string()));
    }
}

#[test]
fn each_block_fetches_its_own_weights_between_its_hooks() {
    // Tied models' lm_head reads the embedding: the one cross-block fetch.
    for model in [
        "tiny-llama",
        "tiny-qwen2",
        "tiny-gpt2",
        "tiny-qwen3",
        "tiny-gemma2",
        "tiny-phi3",
    ] {
        let events = Arc::new(Mutex::new(Vec::new()));
        let source = Recording {
            inner: FolderWeights::open(fixture(model), None).unwrap(),
            events: Arc::clone(&events),
        };
        let reference = CausalLm::open(fixture(model), None).unwrap();
        let config = reference.decoder().config().clone();
        let tied = config.tie_word_embeddings;
        let lm = CausalLm::with_weights(
            fixture(model),
            config,
            bm_tensor::DType::F32,
            Box::new(source),
        )
        .unwrap();
        let options = GenerateOptions {
            max_new_tokens: 2,
            ..GenerateOptions::default()
        };
        let tokens = lm.generate_ids(&[1, 2, 3], &options).unwrap().tokens;
        assert_eq!(
            tokens,
            reference.generate_ids(&[1, 2, 3], &options).unwrap().tokens
        );

        let events = events.lock().unwrap().clone();
        let blocks: Vec<String> = events
            .iter()
            .filter_map(|e| match e {
                Event::Begin(b) => Some(b.clone()),
                _ => None,
            })
            .collect();
        // Two forward passes, each through every block in order.
        let names = lm.decoder().block_names();
        let outside_layers = if model == "tiny-gpt2" { 4 } else { 3 };
        assert_eq!(names.len(), 3 + outside_layers);
        assert_eq!(blocks, [names.clone(), names].concat(), "{model}");

        let mut open: Option<String> = None;
        let mut fetched = 0;
        for event in &events {
            match event {
                Event::Begin(b) => {
                    assert!(open.is_none(), "{b} begins inside {open:?}");
                    open = Some(b.clone());
                }
                Event::End(b) => {
                    assert_eq!(open.as_deref(), Some(b.as_str()));
                    open = None;
                }
                Event::Fetch(name) => {
                    fetched += 1;
                    let block = open.as_deref().expect("fetch outside a block");
                    let own = name.starts_with(&format!("{block}."));
                    let tied_head = tied
                        && block == "lm_head"
                        && *name == lm.decoder().config().embedding_weight();
                    assert!(own || tied_head, "{block} fetched {name}");
                }
            }
        }
        assert!(open.is_none());
        // Every tensor of the checkpoint is used by each pass (a tied
        // weight twice).
        let stored = FolderWeights::open(fixture(model), None)
            .unwrap()
            .checkpoint()
            .len();
        let per_pass = stored + usize::from(tied);
        assert_eq!(fetched, 2 * per_pass, "{model}");
    }
}
