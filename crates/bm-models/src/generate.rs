//! Generation with the KV cache: one prompt, or several left-padded into a
//! batch that runs one forward pass per step for all of them; the next
//! token chosen as `sampling.rs` says; each sequence ending at a stop token
//! or at its length, and never past the model's positions.

use std::time::Instant;

use crate::decoder::{CausalLm, Decoder, KvCache, Logits};
use crate::sampling::{Pcg32, Sampling};
use crate::weights::WeightSource;
use crate::{Error, GenerationConfig, Tensor};

/// The token left padding is filled with: any id in the vocabulary does,
/// since no real position attends to padding.
const PAD_ID: u32 = 0;

/// How to generate.
#[derive(Clone, Debug, Default)]
pub struct GenerateOptions {
    /// Tokens to generate at most for each prompt. Lowered for a prompt
    /// that would otherwise run past the model's `max_position_embeddings`
    /// ([`Generation::capped_to`] says so). Nothing is reserved in
    /// proportion to it: caches grow as tokens come.
    pub max_new_tokens: usize,
    /// Tokens that end a sequence (kept in its output), usually the
    /// config's `eos_token_id`; empty to always generate `max_new_tokens`.
    pub stop_tokens: Vec<u32>,
    /// Keep each prompt's logits (`[prompt_len, vocab]`, F32 values in the
    /// compute dtype) from the first forward pass.
    pub keep_prompt_logits: bool,
    /// Greedy decoding (the default) or sampling, and the logits
    /// processors.
    pub sampling: Sampling,
    /// The random stream of the first prompt: prompt i draws from stream
    /// `first_stream + i` of `sampling.seed`. A caller running a long list
    /// of prompts in batches passes the index of each batch's first prompt,
    /// so every prompt draws the same tokens whatever the batch size.
    pub first_stream: u64,
}

/// How many prompts run together in [`CausalLm::generate_in_batches`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BatchSize {
    /// At most this many (at least 1).
    Fixed(usize),
    /// All of them, halved after every out-of-memory error until a batch
    /// fits ([`bigmodel::find_executable_batch_size`]).
    Auto,
}

/// What [`CausalLm::generate_in_batches`] produced.
#[derive(Debug)]
pub struct Batched {
    /// One generation per prompt, in order.
    pub generations: Vec<Generation>,
    /// The batch size that ran last (the one that fitted, with
    /// [`BatchSize::Auto`]).
    pub batch_size: usize,
    /// Wall time of each forward pass of each batch that ran, in order.
    pub batch_seconds: Vec<Vec<f64>>,
}

/// What generation produced for one prompt.
#[derive(Debug)]
pub struct Generation {
    /// The new tokens (the prompt is not repeated).
    pub tokens: Vec<u32>,
    /// The first forward pass's logits of this prompt, when asked for.
    pub prompt_logits: Option<Tensor>,
    /// Wall time of each forward pass of the batch this prompt ran in; the
    /// first one is the prompts'.
    pub step_seconds: Vec<f64>,
    /// The number of new tokens `max_new_tokens` was lowered to, when the
    /// model's `max_position_embeddings` left less room.
    pub capped_to: Option<usize>,
}

/// One sequence of a batch being generated.
struct Sequence {
    /// Its index among the caller's prompts.
    index: usize,
    /// Prompt and generated tokens (what the repetition penalty sees).
    history: Vec<u32>,
    /// New tokens it may have.
    limit: usize,
    rng: Pcg32,
}

impl Decoder {
    /// Generation from one prompt: the prompt in one forward pass, then one
    /// token per pass.
    pub fn generate(
        &self,
        src: &dyn WeightSource,
        prompt: &[u32],
        options: &GenerateOptions,
    ) -> Result<Generation, Error> {
        let mut out = self.generate_batch(src, &[prompt], options, &mut |_, _| {})?;
        Ok(out.pop().expect("one prompt gives one generation"))
    }

    /// Generation from several prompts at once. The prompts are padded on
    /// the left to the longest, with an attention mask and positions as
    /// transformers makes them for a left-padded batch, and run in one
    /// forward pass; then each step runs the last token of every unfinished
    /// sequence in one pass. A sequence leaves the batch at a stop token or
    /// at its length. Each prompt gets what it would get alone (greedy
    /// decoding: the same tokens; Phi-3's LongRoPE, as in transformers,
    /// picks its factors by the batch's longest sequence).
    /// `on_token(i, token)` is called as each token of prompt i is chosen.
    pub fn generate_batch(
        &self,
        src: &dyn WeightSource,
        prompts: &[impl AsRef<[u32]>],
        options: &GenerateOptions,
        on_token: &mut dyn FnMut(usize, u32),
    ) -> Result<Vec<Generation>, Error> {
        if prompts.is_empty() {
            return Err(Error::EmptyInput("list of prompts"));
        }
        if prompts.iter().any(|p| p.as_ref().is_empty()) {
            return Err(Error::EmptyInput("prompt"));
        }
        let longest = prompts.iter().map(|p| p.as_ref().len()).max().unwrap_or(0);
        let pads: Vec<usize> = prompts.iter().map(|p| longest - p.as_ref().len()).collect();
        let mut input = Vec::with_capacity(longest * prompts.len());
        for t in 0..longest {
            for (prompt, &pad) in prompts.iter().zip(&pads) {
                input.push(t.checked_sub(pad).map_or(PAD_ID, |i| prompt.as_ref()[i]));
            }
        }
        let sequences = prompts
            .iter()
            .enumerate()
            .map(|(index, p)| self.sequence(index, p.as_ref().to_vec(), options))
            .collect::<Result<Vec<_>, Error>>()?;
        let mut cache = self.new_batch_cache(&pads)?;
        self.run(src, &mut cache, input, sequences, options, on_token)
    }

    /// Generation for one sequence whose first `cache.len()` tokens of
    /// `history` are already in `cache` (a conversation's earlier turns):
    /// only the rest of `history` runs, then generation goes on as in
    /// [`Decoder::generate`]. Afterwards `cache` holds `history` and the
    /// new tokens but the last (which was never run).
    pub fn generate_continuing(
        &self,
        src: &dyn WeightSource,
        cache: &mut KvCache,
        history: &[u32],
        options: &GenerateOptions,
        on_token: &mut dyn FnMut(usize, u32),
    ) -> Result<Generation, Error> {
        if cache.batch() != 1 {
            return Err(Error::BadOperands {
                op: "generate_continuing",
                message: format!("a cache of {} sequences; it takes one", cache.batch()),
            });
        }
        if history.is_empty() {
            return Err(Error::EmptyInput("prompt"));
        }
        // At least the last token runs: its logits choose the next one.
        if cache.len() >= history.len() {
            cache.truncate(history.len() - 1)?;
        }
        let input = history[cache.len()..].to_vec();
        let sequence = self.sequence(0, history.to_vec(), options)?;
        let mut out = self.run(src, cache, input, vec![sequence], options, on_token)?;
        Ok(out.pop().expect("one sequence gives one generation"))
    }

    /// Sequence `index` of a generation, with its length limit.
    fn sequence(
        &self,
        index: usize,
        history: Vec<u32>,
        options: &GenerateOptions,
    ) -> Result<(Sequence, Option<usize>), Error> {
        if options.max_new_tokens == 0 {
            return Err(Error::BadGenerateOption {
                option: "max_new_tokens",
                message: "must be at least 1".into(),
            });
        }
        let mut limit = options.max_new_tokens;
        let mut capped = None;
        if let Some(max) = self.config().max_positions {
            let len = history.len();
            let room = max
                .checked_sub(len)
                .filter(|room| *room > 0)
                .ok_or(Error::SequenceTooLong { len: len + 1, max })?;
            if room < limit {
                limit = room;
                capped = Some(room);
            }
        }
        let stream = options.first_stream.wrapping_add(index as u64);
        let sequence = Sequence {
            index,
            history,
            limit,
            rng: Pcg32::new(options.sampling.seed, stream),
        };
        Ok((sequence, capped))
    }

    /// The decoding loop over `cache`'s batch, starting with `input`
    /// (time-major), one [`Sequence`] per sequence of the batch in order.
    fn run(
        &self,
        src: &dyn WeightSource,
        cache: &mut KvCache,
        mut input: Vec<u32>,
        sequences: Vec<(Sequence, Option<usize>)>,
        options: &GenerateOptions,
        on_token: &mut dyn FnMut(usize, u32),
    ) -> Result<Vec<Generation>, Error> {
        options.sampling.check()?;
        let vocab = self.config().vocab_size;
        let mut out: Vec<Generation> = sequences
            .iter()
            .map(|(_, capped_to)| Generation {
                tokens: Vec::new(),
                prompt_logits: None,
                step_seconds: Vec::new(),
                capped_to: *capped_to,
            })
            .collect();
        let mut live: Vec<Sequence> = sequences.into_iter().map(|(s, _)| s).collect();
        let mut step_seconds = Vec::new();
        while !live.is_empty() {
            let started = Instant::now();
            let want = if step_seconds.is_empty() && options.keep_prompt_logits {
                Logits::All
            } else {
                Logits::Last
            };
            let start = cache.len();
            let logits = self.forward(src, &input, cache, want)?;
            let batch = live.len();
            let last = match want {
                Logits::All => {
                    let pads = cache.pads();
                    for (b, seq) in live.iter().enumerate() {
                        let first_real = pads[b].saturating_sub(start);
                        out[seq.index].prompt_logits =
                            Some(sequence_rows(&logits, batch, b, first_real)?);
                    }
                    let rows = logits.shape()[0];
                    logits.rows(rows - batch, rows)?
                }
                Logits::Last => logits,
            };
            let mut values = last.to_host()?.to_f32_vec();
            let mut keep = Vec::with_capacity(batch);
            input.clear();
            for (seq, row) in live.iter_mut().zip(values.chunks_exact_mut(vocab)) {
                let token = options.sampling.choose(row, &seq.history, &mut seq.rng);
                seq.history.push(token);
                let tokens = &mut out[seq.index].tokens;
                tokens.push(token);
                on_token(seq.index, token);
                let done = options.stop_tokens.contains(&token) || tokens.len() >= seq.limit;
                keep.push(!done);
                if !done {
                    input.push(token);
                }
            }
            step_seconds.push(started.elapsed().as_secs_f64());
            if input.is_empty() {
                break;
            }
            if input.len() < batch {
                cache.retain(&keep)?;
                let mut flags = keep.iter();
                live.retain(|_| *flags.next().unwrap_or(&false));
            }
        }
        for generation in &mut out {
            generation.step_seconds = step_seconds.clone();
        }
        Ok(out)
    }
}

/// Rows of sequence `b` of a time-major `[steps * batch, vocab]` logits
/// tensor, from step `first` on: `[steps - first, vocab]`.
fn sequence_rows(logits: &Tensor, batch: usize, b: usize, first: usize) -> Result<Tensor, Error> {
    let host = logits.to_host()?;
    let values = host.f32_values();
    let vocab = logits.shape()[1];
    let steps = logits.shape()[0] / batch;
    let rows: Vec<f32> = (first..steps)
        .flat_map(|i| values[(i * batch + b) * vocab..][..vocab].iter().copied())
        .collect();
    Ok(Tensor::from_f32(
        logits.dtype(),
        &[steps - first, vocab],
        &rows,
    )?)
}

/// A conversation's KV cache and the tokens it holds, kept between turns
/// so that each turn runs only what is new since the cache was filled.
#[derive(Debug)]
pub struct Conversation {
    cache: KvCache,
    tokens: Vec<u32>,
}

impl Conversation {
    /// Tokens whose keys and values the cache holds.
    pub fn cached_tokens(&self) -> &[u32] {
        &self.tokens
    }
}

impl CausalLm {
    /// An empty conversation for [`CausalLm::generate_in_conversation`].
    pub fn new_conversation(&self) -> Conversation {
        Conversation {
            cache: self.decoder.new_cache(),
            tokens: Vec::new(),
        }
    }

    /// Generation from `history`, the whole conversation so far as the
    /// chat template renders it: the cache is rewound to the longest
    /// prefix it shares with `history` and only the rest runs (a sliding
    /// window that already dropped part of that prefix starts the cache
    /// afresh). The tokens are those a fresh generation from `history`
    /// gives.
    pub fn generate_in_conversation(
        &self,
        conversation: &mut Conversation,
        history: &[u32],
        options: &GenerateOptions,
        on_token: &mut dyn FnMut(usize, u32),
    ) -> Result<Generation, Error> {
        // At least the last token of the history runs: its logits choose
        // the first new token.
        let shared = conversation
            .tokens
            .iter()
            .zip(history)
            .take_while(|(a, b)| a == b)
            .count()
            .min(history.len().saturating_sub(1));
        if conversation.cache.truncate(shared).is_err() {
            *conversation = self.new_conversation();
        }
        conversation.tokens.truncate(conversation.cache.len());
        let generation = self.decoder.generate_continuing(
            self.weights.as_ref(),
            &mut conversation.cache,
            history,
            options,
            on_token,
        )?;
        // The cache holds the history and every new token but the last.
        conversation.tokens = history.to_vec();
        let ran = generation.tokens.len().saturating_sub(1);
        conversation.tokens.extend(&generation.tokens[..ran]);
        Ok(generation)
    }

    /// The folder's generation defaults (`generation_config.json`).
    pub fn generation_config(&self) -> &GenerationConfig {
        &self.generation
    }

    /// Generation from token ids.
    pub fn generate_ids(
        &self,
        prompt: &[u32],
        options: &GenerateOptions,
    ) -> Result<Generation, Error> {
        self.decoder
            .generate(self.weights.as_ref(), prompt, options)
    }

    /// Generation from several prompts' token ids at once (see
    /// [`Decoder::generate_batch`]).
    pub fn generate_batch(
        &self,
        prompts: &[impl AsRef<[u32]>],
        options: &GenerateOptions,
        on_token: &mut dyn FnMut(usize, u32),
    ) -> Result<Vec<Generation>, Error> {
        self.decoder
            .generate_batch(self.weights.as_ref(), prompts, options, on_token)
    }

    /// Generation from many prompts, `batch_size` of them at a time, in
    /// order. With [`BatchSize::Auto`] the first batch holds every prompt
    /// and the size is halved whenever a batch runs out of device memory
    /// (`on_retry(new_size, error)` is told), batches done before are kept.
    /// Prompt i draws its samples from stream `first_stream + i` whatever
    /// the batch size, so a seed gives the same tokens however they are
    /// batched.
    pub fn generate_in_batches(
        &self,
        prompts: &[Vec<u32>],
        batch_size: BatchSize,
        options: &GenerateOptions,
        on_token: &mut dyn FnMut(usize, u32),
        on_retry: &mut dyn FnMut(usize, &Error),
    ) -> Result<Batched, Error> {
        if prompts.is_empty() {
            return Err(Error::EmptyInput("list of prompts"));
        }
        let mut done: Vec<Generation> = Vec::with_capacity(prompts.len());
        let mut batch_seconds = Vec::new();
        let mut run = |size: usize| -> Result<usize, Error> {
            while done.len() < prompts.len() {
                let first = done.len();
                let chunk = &prompts[first..(first + size).min(prompts.len())];
                let chunk_options = GenerateOptions {
                    first_stream: options.first_stream.wrapping_add(first as u64),
                    ..options.clone()
                };
                let mut offset = |i: usize, token: u32| on_token(first + i, token);
                let generations = self.generate_batch(chunk, &chunk_options, &mut offset)?;
                batch_seconds.push(generations[0].step_seconds.clone());
                done.extend(generations);
            }
            Ok(size)
        };
        let size = match batch_size {
            BatchSize::Fixed(0) => {
                return Err(Error::BadGenerateOption {
                    option: "batch_size",
                    message: "must be at least 1".into(),
                });
            }
            BatchSize::Fixed(size) => run(size)?,
            BatchSize::Auto => {
                let mut tries = |size: usize| {
                    let result = run(size);
                    if let Err(e) = &result
                        && bigmodel::OutOfMemory::is_out_of_memory(e)
                        && size > 1
                    {
                        on_retry(size / 2, e);
                    }
                    result
                };
                bigmodel::find_executable_batch_size(prompts.len(), &mut tries)?
            }
        };
        Ok(Batched {
            generations: done,
            batch_size: size,
            batch_seconds,
        })
    }

    /// Generation from text: returns the generation and its new tokens
    /// decoded.
    pub fn generate_text(
        &self,
        prompt: &str,
        options: &GenerateOptions,
    ) -> Result<(Generation, String), Error> {
        let ids = self.encode(prompt)?;
        let generation = self.generate_ids(&ids, options)?;
        let text = self.decode(&generation.tokens)?;
        Ok((generation, text))
    }

    /// Token ids of a chat template's output: no special tokens added,
    /// since the template writes them (as `apply_chat_template` encodes).
    pub fn encode_chat(&self, rendered: &str) -> Result<Vec<u32>, Error> {
        if rendered.is_empty() {
            return Err(Error::EmptyInput("rendered conversation"));
        }
        self.text_tokenizer()?.encode(rendered, false)
    }

    /// Token ids of `text`, with the special tokens the tokenizer adds.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, Error> {
        if text.is_empty() {
            return Err(Error::EmptyInput("prompt"));
        }
        self.text_tokenizer()?.encode(text, true)
    }

    /// Text of `ids`, special tokens skipped.
    pub fn decode(&self, ids: &[u32]) -> Result<String, Error> {
        self.text_tokenizer()?.decode(ids)
    }

    /// The tokenizer, or the error saying the folder has none.
    pub(crate) fn text_tokenizer(&self) -> Result<&crate::TextTokenizer, Error> {
        self.tokenizer.as_ref().ok_or_else(|| Error::NoTokenizer {
            dir: self.dir.clone(),
        })
    }
}
