//! The generation routes: validate (sync, `kura_api::validate`), tokenize on the blocking pool (a
//! 200 KB prompt must not stall the two async workers that serve every stream and `/health`), submit
//! one engine request per prompt, then collect or stream the merged events ([`crate::output`]).

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::extract::State;
use axum::http::header;
use axum::response::sse::{KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use futures::StreamExt;
use kura_engine::{ChatMessage, EngineHandle, GenerateRequest, TextCodec};

use crate::body::JsonBody;
use crate::caches;
use crate::caching::{self, SavedContext};
use crate::error::ApiError;
use crate::guided;
use crate::output::{self, Events, ResponseMeta, Shape};
use crate::types::PromptTokenIds;
use crate::types::{TokenizeRequest, TokenizeResponse};
use crate::validate::{self, template_error, tokenize_error, Checked, PromptInput};
use crate::AppState;
use kura_api::tools::prompt_messages;
use kura_api::{effective_salt, Tenant};

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// A new response id: `prefix`, `-` and [`crate::caching::random_hex96`]. Random, not counted:
/// a server-wide counter in the ids a tenant gets back told it how many requests the others made in
/// between, and made stored responses' ids guessable.
pub(crate) fn response_id(prefix: &str) -> String {
    format!("{prefix}-{}", crate::caching::random_hex96())
}

/// Runs tokenizer work on the blocking pool, so that the async workers stay free.
pub(crate) async fn off_the_workers<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ApiError::Internal(format!("tokenizer task failed: {e}")))?
}

/// Token ids of every prompt, tokenized off the async workers.
async fn encode_prompts(
    engine: &EngineHandle,
    prompts: Vec<PromptInput>,
) -> Result<Vec<Vec<u32>>, ApiError> {
    let codec = engine.codec().clone();
    off_the_workers(move || {
        prompts
            .into_iter()
            .map(|p| match p {
                PromptInput::Text(t) => codec.encode(&t).map_err(tokenize_error),
                PromptInput::Tokens(t) => Ok(t),
            })
            .collect()
    })
    .await
}

/// What `echo` starts each prompt's choices with: the prompt's text as given, or a token prompt's
/// tokens decoded.
async fn echo_prompts(
    engine: &EngineHandle,
    texts: Vec<Option<String>>,
    prompts: &[Vec<u32>],
) -> Result<std::sync::Arc<[String]>, ApiError> {
    let codec = engine.codec().clone();
    let prompts = prompts.to_vec();
    off_the_workers(move || {
        Ok(texts
            .into_iter()
            .zip(&prompts)
            .map(|(text, tokens)| text.unwrap_or_else(|| codec.decode(tokens)))
            .collect())
    })
    .await
}

/// The chat template applied and tokenized in one step, off the async workers: the template writes
/// the special tokens, so none are added again (no second BOS).
async fn encode_chat(
    codec: Arc<dyn TextCodec>,
    messages: Vec<ChatMessage>,
) -> Result<Vec<u32>, ApiError> {
    off_the_workers(move || codec.encode_chat(&messages).map_err(template_error)).await
}

/// [`encode_chat`] with tool definitions for a template that has a tools section.
async fn encode_chat_tools(
    codec: Arc<dyn TextCodec>,
    messages: Vec<ChatMessage>,
    tools: serde_json::Value,
) -> Result<Vec<u32>, ApiError> {
    off_the_workers(move || {
        codec
            .encode_chat_with_tools(&messages, &tools)
            .map_err(template_error)
    })
    .await
}

/// [`validate::chat_codec`] of the served model's codec and a request's template arguments, off the
/// async workers (their values are checked, and a body may hold many).
async fn chat_codec(
    engine: &EngineHandle,
    template: Option<String>,
    kwargs: Option<serde_json::Map<String, serde_json::Value>>,
) -> Result<(Arc<dyn TextCodec>, bool), ApiError> {
    let base = engine.codec().clone();
    off_the_workers(move || validate::chat_codec(&base, template.as_deref(), kwargs.as_ref())).await
}

/// [`kura_api::tools::history_tokens`] of a request's prompt, off the async workers.
pub(crate) async fn history_of(
    codec: Arc<dyn TextCodec>,
    conversation: Vec<ChatMessage>,
    tools: Option<kura_api::tools::ToolPlan>,
    request: &GenerateRequest,
) -> Result<usize, ApiError> {
    let prompt = request.prompt_tokens.clone();
    off_the_workers(move || {
        Ok(kura_api::tools::history_tokens(
            codec.as_ref(),
            &conversation,
            tools.as_ref(),
            &prompt,
        ))
    })
    .await
}

/// Default `max_tokens` when the client gives none: whatever fits in the context and in the pool.
pub(crate) fn remaining_tokens(engine: &EngineHandle, prompt_len: usize) -> u32 {
    let room = context_tokens(engine).saturating_sub(prompt_len);
    room.clamp(1, u32::MAX as usize) as u32
}

/// The most tokens one sequence may hold, prompt and output: the context, or the pool where it is
/// smaller.
pub(crate) fn context_tokens(engine: &EngineHandle) -> usize {
    let info = engine.info();
    info.max_model_len.min(info.pool_tokens())
}

/// `/v1/completions`' `max_tokens` when the request gives none (OpenAI's default for the legacy
/// endpoint).
const COMPLETIONS_MAX_TOKENS: u32 = 16;

/// Takes `count` of the server's log-probabilities for a response that holds them until it is sent
/// (non-streamed, with log-probabilities, or with a scored prompt, streamed or not; 0 takes nothing):
/// held until the returned permit drops (the response's body sent or dropped, or the request dropped
/// with its connection). Over the server's bound: 429.
fn hold_logprobs(
    s: &AppState,
    count: u64,
) -> Result<Option<tokio::sync::OwnedSemaphorePermit>, ApiError> {
    if count == 0 {
        return Ok(None);
    }
    // What the others hold is not said: it would count other tenants' requests as they run.
    let busy = || {
        ApiError::QueueFull(format!(
            "responses in progress hold too many of this server's {} log-probabilities (those not \
             streamed, and scored prompts) for this one's {count}: retry later, or stream the \
             response (a stream holds only its scored prompts)",
            s.max_held_logprobs
        ))
    };
    // `count` is at most `held_logprobs_limit()` (validated), at most 2^20.
    let n = u32::try_from(count).map_err(|_| busy())?;
    match s.held_logprobs.clone().try_acquire_many_owned(n) {
        Ok(permit) => Ok(Some(permit)),
        Err(_) => Err(busy()),
    }
}

/// The log-probabilities a response holds for its scored prompts (`lens`: each prompt's tokens; `n`:
/// the copies of each prompt's scores it carries; `tops`: the alternatives a token of each form it
/// writes them in, `None` for a form not asked), refused past `limit` naming `param`. A prompt's scores
/// are computed whole before any is sent, so a stream holds them too, once (its choices write them in
/// turn from one copy).
fn prompt_scores_held(
    checked: &Checked,
    n: usize,
    tops: &[Option<u32>],
    lens: &[usize],
    limit: u64,
    param: &'static str,
) -> Result<u64, ApiError> {
    let copies = if checked.stream { 1 } else { n.max(1) as u64 };
    let held = tops
        .iter()
        .flatten()
        .flat_map(|&top| {
            lens.iter()
                .map(move |&len| validate::logprobs_of(copies, top, len as u64))
        })
        .fold(0u64, u64::saturating_add);
    if held > limit {
        let lower = if copies > 1 { "n or " } else { "" };
        let stream = match checked.stream {
            true => "",
            false => ", or stream the response",
        };
        return Err(ApiError::invalid(
            format!(
                "a response holds at most {limit} log-probabilities on this server, and its scored \
                 prompts alone hold {held} (each prompt's tokens × the copies of its scores the \
                 response writes × (1 + the alternatives a token); a prompt is scored whole before \
                 any of it is sent, streamed or not); lower {lower}{param}, or shorten the \
                 prompt{stream}"
            ),
            Some(param),
        ));
    }
    Ok(held)
}

/// Submits one engine request per prompt and answers with the merged events, as JSON or SSE. `held`:
/// the response's share of the server's log-probabilities, kept until its body is sent or dropped.
async fn start(
    s: &AppState,
    requests: Vec<GenerateRequest>,
    meta: ResponseMeta,
    stream: bool,
    include_usage: bool,
    held: Option<tokio::sync::OwnedSemaphorePermit>,
    deadline: output::Deadline,
) -> Result<Response, ApiError> {
    output::before_deadline(deadline)?;
    let n = requests.first().map(|r| r.n).unwrap_or(1);
    let (mut events, sender) = Events::new(requests.len() as u32, n);
    for (i, request) in requests.into_iter().enumerate() {
        // A refusal drops the guards of the prompts already submitted: they are cancelled.
        let guard = s.engine.submit(request, sender.sink(i as u32))?;
        events.add_guard(guard);
    }
    drop(sender);
    if stream {
        // A stream's held share (its scored prompts) is kept until the stream ends or is dropped.
        let body = output::sse_stream(meta, include_usage, events, deadline).map(move |e| {
            let _held = &held;
            e
        });
        Ok(Sse::new(body)
            .keep_alive(KeepAlive::default())
            .into_response())
    } else {
        let body = output::finish_before(deadline, output::collect(&meta, events)).await?;
        let Some(held) = held else {
            return Ok(([(header::CONTENT_TYPE, "application/json")], body).into_response());
        };
        // The log-probabilities are in `body` now, in the form sent: it keeps their share of the
        // bound until it has been written out (a client may read slowly) or dropped.
        Ok(held_body(body, held))
    }
}

/// A JSON body of `bytes` that keeps `held` until the body has been sent or dropped: pieces of 64 KiB
/// of one buffer, with its length declared.
fn held_body(bytes: Vec<u8>, held: tokio::sync::OwnedSemaphorePermit) -> Response {
    const PIECE: usize = 64 * 1024;
    let len = bytes.len();
    let bytes = axum::body::Bytes::from(bytes);
    let pieces = (0..len)
        .step_by(PIECE)
        .map(move |at| Ok::<_, std::convert::Infallible>(bytes.slice(at..(at + PIECE).min(len))));
    let stream = futures::stream::iter(pieces).map(move |piece| {
        let _held = &held;
        piece
    });
    (
        [
            (header::CONTENT_TYPE, "application/json".to_string()),
            (header::CONTENT_LENGTH, len.to_string()),
        ],
        axum::body::Body::from_stream(stream),
    )
        .into_response()
}

fn request_for(
    s: &AppState,
    checked: &Checked,
    salt: &Option<String>,
    prompt_tokens: Vec<u32>,
    max_tokens: u32,
    logprobs: Option<u32>,
    context: Option<&SavedContext>,
) -> Result<GenerateRequest, ApiError> {
    // A prompt too long for the context is the engine's to refuse, naming it.
    if prompt_tokens.len() < context_tokens(&s.engine) {
        checked.check_min_tokens(max_tokens)?;
    }
    let now = s.engine.cache_now_ms();
    let retention = caching::retention_pin(
        checked.prompt_cache_retention.as_deref(),
        prompt_tokens.len(),
        now,
    )?;
    let mut request = checked
        .clone()
        .into_request(prompt_tokens, max_tokens, logprobs);
    request.sampling.bad_words =
        validate::bad_word_tokens(s.engine.codec().as_ref(), &checked.bad_words)?;
    // The tenant's salt with the request's own, as its grammar was kept under.
    request.cache_salt = salt.clone();
    request.pins.extend(context.map(SavedContext::pin_spec));
    request.pins.extend(retention);
    Ok(request)
}

/// Whether and how a chat answer's reasoning is read apart ([`output::ResponseMeta::reasoning`]), and
/// its grammar put after it ([`guided::constraint`]): on a server that reads reasoning, whether the
/// prompt (`codec` wrote it) ends inside it.
pub(crate) fn thinking_of(
    s: &AppState,
    codec: &dyn kura_engine::TextCodec,
    prompt: &[u32],
) -> Option<bool> {
    s.reasoning
        .then(|| kura_api::reasoning::prompt_ends_thinking(codec, prompt))
}

/// Saved context `id` of the tenant whose salt is `salt`, checked on the blocking pool: its first
/// use after a restart tokenizes its text (up to 64 MiB of it) against its tokens.
pub(crate) async fn use_saved_context(
    s: &AppState,
    id: &str,
    salt: Option<String>,
) -> Result<SavedContext, ApiError> {
    let (store, engine, id) = (s.contexts.clone(), s.engine.clone(), id.to_string());
    off_the_workers(move || store.use_context(&id, &salt, &engine)).await
}

/// The saved context a request names (`cached_content`), checked against its tenant and the model.
async fn saved_context(
    s: &AppState,
    checked: &Checked,
    tenant: &Tenant,
) -> Result<Option<SavedContext>, ApiError> {
    match &checked.cached_content {
        // A context is owned, and its blocks are salted, by its tenant alone (as it was created): a
        // request salt would look for another owner and put the request's blocks under another key.
        Some(_) if checked.cache_salt.is_some() => Err(ApiError::invalid(
            "cache_salt cannot be combined with cached_content: a saved context's KV belongs to \
             its API key, not to a salt",
            Some("cache_salt"),
        )),
        Some(id) => {
            let salt = effective_salt(tenant, None);
            use_saved_context(s, id, salt).await.map(Some)
        }
        None => Ok(None),
    }
}

pub async fn completions(
    State(s): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    Extension(arrival): Extension<output::Arrival>,
    JsonBody(value): JsonBody,
) -> Result<Response, ApiError> {
    let deadline = output::deadline(s.request_timeout, arrival);
    let info = s.engine.info();
    let plan = validate::prepare_completion(&value, s.ctx())?;
    drop(value);
    // The request's cache salt: its blocks' and its kept grammar's.
    let salt = effective_salt(&tenant, plan.checked.cache_salt.clone());
    let context = saved_context(&s, &plan.checked, &tenant).await?;
    let style = guided::tool_style(&s.engine);
    let constraint = guided::constraint(
        &s.engine,
        &s.guides,
        salt.clone(),
        plan.checked.guide.clone(),
        None,
        style,
        None,
        None,
        deadline,
    )
    .await?;
    // `echo`: the prompts' texts as given (token prompts are decoded once tokenized).
    let echo_texts: Option<Vec<Option<String>>> = plan.echo.then(|| {
        plan.prompts
            .iter()
            .map(|p| match p {
                PromptInput::Text(t) => Some(t.clone()),
                PromptInput::Tokens(_) => None,
            })
            .collect()
    });
    let prompts = match &context {
        None => encode_prompts(&s.engine, plan.prompts).await?,
        Some(c) => {
            let (codec, c) = (s.engine.codec().clone(), c.clone());
            off_the_workers(move || {
                plan.prompts
                    .into_iter()
                    .map(|p| match p {
                        PromptInput::Text(t) => caches::completion_tokens(codec.as_ref(), &c, &t),
                        PromptInput::Tokens(t) => Ok([c.tokens.as_slice(), &t].concat()),
                    })
                    .collect()
            })
            .await?
        }
    };
    let mut prompts = prompts;
    for p in &mut prompts {
        plan.checked
            .truncate_prompt(p, context_tokens(&s.engine), COMPLETIONS_MAX_TOKENS);
    }
    let echo = match echo_texts {
        Some(texts) => Some(echo_prompts(&s.engine, texts, &prompts).await?),
        None => None,
    };
    // The prompts scored (an echo with `logprobs`, vLLM's `prompt_logprobs`) with the most
    // alternatives either asks; held with the output's (each choice repeats them).
    let scored = plan
        .logprobs
        .filter(|_| plan.echo)
        .max(plan.prompt_logprobs);
    let choices = prompts.len().saturating_mul(plan.checked.n as usize);
    let limit = s.held_logprobs_limit();
    let lens: Vec<usize> = prompts.iter().map(Vec::len).collect();
    let param = match plan.prompt_logprobs {
        Some(_) => "prompt_logprobs",
        None => "logprobs",
    };
    // Each choice writes the echo's legacy arrays and vLLM's `prompt_logprobs` apart.
    let prompt_held = prompt_scores_held(
        &plan.checked,
        plan.checked.n as usize,
        &[plan.logprobs.filter(|_| plan.echo), plan.prompt_logprobs],
        &lens,
        limit,
        param,
    )?;
    // OpenAI's default for the legacy endpoint.
    let max_tokens = match plan.checked.max_tokens {
        // A prompt scored alone (`echo` with `max_tokens` 0).
        Some(0) => 0,
        asked => validate::held_logprobs_max_tokens(
            &plan.checked,
            choices,
            plan.logprobs,
            "logprobs",
            asked.unwrap_or(COMPLETIONS_MAX_TOKENS),
            limit - prompt_held,
        )?,
    };
    let token_ids = plan.checked.return_token_ids && !plan.checked.stream;
    let prompt_token_ids: Vec<PromptTokenIds> = match token_ids {
        true => prompts
            .iter()
            .map(|p| PromptTokenIds(p.as_slice().into()))
            .collect(),
        false => Vec::new(),
    };
    let requests: Vec<GenerateRequest> = prompts
        .into_iter()
        .map(|p| {
            request_for(
                &s,
                &plan.checked,
                &salt,
                p,
                max_tokens,
                plan.logprobs,
                context.as_ref(),
            )
            .map(|mut r| {
                r.constraint = constraint.clone();
                r.prompt_logprobs = scored.map(|k| k as usize);
                r
            })
        })
        .collect::<Result<_, _>>()?;
    tracing::debug!(user = ?plan.user, prompts = requests.len(), max_tokens, "completion request");
    let meta = ResponseMeta {
        id: response_id("cmpl"),
        created: unix_now(),
        model: info.model_name.clone(),
        shape: Shape::Completion,
        logprobs: plan.logprobs.is_some(),
        token_ids,
        prompt_token_ids,
        tools: None,
        echo,
        top_logprobs: plan.logprobs.unwrap_or(0),
        prompt_logprobs: plan.prompt_logprobs,
        reasoning: None,
    };
    let (stream, include_usage) = (plan.checked.stream, plan.checked.include_usage);
    let held = hold_logprobs(
        &s,
        validate::held_logprobs(&plan.checked, choices, plan.logprobs, max_tokens)
            .saturating_add(prompt_held),
    )?;
    start(&s, requests, meta, stream, include_usage, held, deadline).await
}

pub async fn chat_completions(
    State(s): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    Extension(arrival): Extension<output::Arrival>,
    JsonBody(value): JsonBody,
) -> Result<Response, ApiError> {
    let deadline = output::deadline(s.request_timeout, arrival);
    let info = s.engine.info();
    let plan = validate::prepare_chat(&value, s.ctx())?;
    drop(value);
    // The request's cache salt: its blocks' and its kept grammar's.
    let salt = effective_salt(&tenant, plan.checked.cache_salt.clone());
    let context = saved_context(&s, &plan.checked, &tenant).await?;
    // The codec writes the prompt with the request's template and arguments; their errors are given
    // in the names the request used.
    let (own_template, documents) = (plan.chat_template.is_some(), plan.documents);
    let named = move |e| validate::request_template_error(e, own_template, documents);
    let (codec, read) = chat_codec(
        &s.engine,
        plan.chat_template.clone(),
        plan.template_kwargs.clone(),
    )
    .await
    .map_err(named)?;
    let messages_context = context.as_ref().is_some_and(|c| {
        matches!(
            c.kind,
            kura_api::cache_control::ContextKind::Messages { .. }
        )
    });
    if read && messages_context {
        let field = match plan.chat_template {
            Some(_) => "chat_template",
            None => "chat_template_kwargs",
        };
        return Err(ApiError::invalid(
            format!(
                "{field} cannot be combined with a saved context of messages: its messages were \
                 written by the server's template without them, and the request's may write them \
                 otherwise"
            ),
            Some(field),
        ));
    }
    // The template that writes the prompt (the request's own, where it has one) says how tools and
    // calls are written, as `/tokenize` reads it.
    let style = kura_api::tools::ToolStyle::of(codec.as_ref());
    // The conversation as sent, for telling a re-rendered history from a new turn on a miss.
    let conversation = plan
        .closed_messages()
        .iter()
        .any(|m| m.role == "assistant")
        .then(|| plan.closed_messages().to_vec());
    let (messages, _, tools_json) =
        prompt_messages::<()>(plan.messages, plan.tools.as_ref(), style, &[], &[]);
    let mut prompt_tokens: Vec<u32> = async {
        Ok(match (&context, tools_json) {
            // Checked: a saved context does not go with a continued message.
            (None, tools) if plan.continue_final => {
                let codec = codec.clone();
                off_the_workers(move || {
                    codec
                        .encode_chat_continuing(&messages, tools.as_ref())
                        .map_err(template_error)
                })
                .await?
            }
            (None, None) => encode_chat(codec.clone(), messages).await?,
            (None, Some(tools)) => encode_chat_tools(codec.clone(), messages, tools).await?,
            (Some(_), Some(_)) => return Err(ApiError::invalid(
                "cached_content cannot be combined with tools on this model: its chat template \
                 writes the tools itself, ahead of the saved context",
                Some("cached_content"),
            )),
            (Some(c), None) => {
                let (codec, c) = (codec.clone(), c.clone());
                off_the_workers(move || {
                    caching::encode_with_breakpoints(
                        codec.as_ref(),
                        &messages,
                        &[],
                        Some((&c.kind, &c.tokens)),
                    )
                    .map(|(tokens, _)| tokens)
                })
                .await?
            }
        })
    }
    .await
    .map_err(named)?;
    // (Chat refuses -1 without a max_tokens: the default is what the cut leaves.)
    plan.checked
        .truncate_prompt(&mut prompt_tokens, context_tokens(&s.engine), 1);
    let thinking = thinking_of(&s, codec.as_ref(), &prompt_tokens);
    let constraint = guided::constraint(
        &s.engine,
        &s.guides,
        salt.clone(),
        plan.checked.guide.clone(),
        plan.tools.as_ref(),
        style,
        thinking,
        None,
        deadline,
    )
    .await?;
    // vLLM's `prompt_logprobs`: the prompt scored, held once (the response carries it once).
    let limit = s.held_logprobs_limit();
    let prompt_held = prompt_scores_held(
        &plan.checked,
        1,
        &[plan.prompt_logprobs],
        &[prompt_tokens.len()],
        limit,
        "prompt_logprobs",
    )?;
    let max_tokens = validate::held_logprobs_max_tokens(
        &plan.checked,
        plan.checked.n as usize,
        plan.logprobs,
        "top_logprobs",
        plan.checked
            .max_tokens
            .unwrap_or_else(|| remaining_tokens(&s.engine, prompt_tokens.len())),
        limit - prompt_held,
    )?;
    let request = request_for(
        &s,
        &plan.checked,
        &salt,
        prompt_tokens,
        max_tokens,
        plan.logprobs,
        context.as_ref(),
    )?;
    let mut request = request;
    request.constraint = constraint;
    request.prompt_logprobs = plan.prompt_logprobs.map(|k| k as usize);
    // (A prompt cut to its last tokens holds no history from its start.)
    if let Some(conversation) = conversation.filter(|_| plan.checked.truncate_prompt.is_none()) {
        request.history_tokens =
            history_of(codec.clone(), conversation, plan.tools.clone(), &request).await?;
    }
    tracing::debug!(user = ?plan.user, prompt_tokens = request.prompt_tokens.len(), max_tokens, "chat request");
    let meta = ResponseMeta {
        id: response_id("chatcmpl"),
        created: unix_now(),
        model: info.model_name.clone(),
        shape: Shape::Chat,
        logprobs: plan.logprobs.is_some(),
        token_ids: plan.checked.return_token_ids && !plan.checked.stream,
        prompt_token_ids: match plan.checked.return_token_ids && !plan.checked.stream {
            true => vec![PromptTokenIds(request.prompt_tokens.as_slice().into())],
            false => Vec::new(),
        },
        tools: plan.tools.as_ref().and_then(|t| t.reader(style.format)),
        echo: None,
        top_logprobs: plan.logprobs.unwrap_or(0),
        prompt_logprobs: plan.prompt_logprobs,
        reasoning: thinking,
    };
    let (stream, include_usage) = (plan.checked.stream, plan.checked.include_usage);
    let held = hold_logprobs(
        &s,
        validate::held_logprobs(
            &plan.checked,
            plan.checked.n as usize,
            plan.logprobs,
            max_tokens,
        )
        .saturating_add(prompt_held),
    )?;
    start(
        &s,
        vec![request],
        meta,
        stream,
        include_usage,
        held,
        deadline,
    )
    .await
}

pub async fn tokenize(
    State(s): State<AppState>,
    JsonBody(value): JsonBody,
) -> Result<Json<TokenizeResponse>, ApiError> {
    let req: TokenizeRequest = kura_api::body::from_value(&value)?;
    drop(value);
    if let Some(model) = &req.model {
        validate::check_model(model, &s.engine.info().model_name)?;
    }
    if req.prompt.is_some() == req.messages.is_some() {
        return Err(ApiError::invalid(
            "give exactly one of prompt (a string) or messages",
            Some(if req.prompt.is_some() {
                "messages"
            } else {
                "prompt"
            }),
        ));
    }
    let added = req.add_special_tokens.unwrap_or(req.prompt.is_some());
    if req.messages.is_some() && added {
        return Err(ApiError::invalid(
            "add_special_tokens goes with prompt: with messages the chat template writes the special \
             tokens (as the chat route counts them)",
            Some("add_special_tokens"),
        ));
    }
    let continued =
        validate::continues_final_message(req.continue_final_message, req.add_generation_prompt)?;
    if req.chat_template.is_some() && req.messages.is_none() {
        return Err(ApiError::invalid(
            "chat_template goes with messages",
            Some("chat_template"),
        ));
    }
    if req.documents.is_some() && req.messages.is_none() {
        return Err(ApiError::invalid(
            "documents go with messages (the chat template writes them)",
            Some("documents"),
        ));
    }
    if req.chat_template_kwargs.is_some() && req.messages.is_none() {
        return Err(ApiError::invalid(
            "chat_template_kwargs goes with messages (the chat template reads them)",
            Some("chat_template_kwargs"),
        ));
    }
    if (req.add_generation_prompt.is_some() || continued) && req.messages.is_none() {
        return Err(ApiError::invalid(
            "add_generation_prompt goes with messages",
            Some("add_generation_prompt"),
        ));
    }
    let tokens = match (req.prompt, req.messages) {
        (Some(p), None) if req.tools.is_none() && added => {
            encode_prompts(&s.engine, vec![PromptInput::Text(p)])
                .await?
                .swap_remove(0)
        }
        (Some(p), None) if req.tools.is_none() => {
            let codec = s.engine.codec().clone();
            off_the_workers(move || codec.encode_without_added(&p).map_err(tokenize_error)).await?
        }
        (Some(_), None) => {
            return Err(ApiError::invalid(
                "tools go with messages (the chat template writes them), not with prompt",
                Some("tools"),
            ))
        }
        (None, Some(m)) => {
            // As the chat route writes them (tool definitions and tool turns in the template's way).
            let tools = kura_api::tools::openai_tools(req.tools.as_ref(), None, None)?;
            let documents = req.documents.is_some();
            let kwargs = validate::template_arguments(req.chat_template_kwargs, req.documents)?;
            let template = validate::request_chat_template(req.chat_template, s.ctx())?;
            let own_template = template.is_some();
            let named = move |e| validate::request_template_error(e, own_template, documents);
            let (codec, _) = chat_codec(&s.engine, template, kwargs)
                .await
                .map_err(named)?;
            let messages = validate::flatten_messages(&m)?;
            off_the_workers(move || match continued {
                true => kura_api::tools::encode_chat_continuing(
                    codec.as_ref(),
                    messages,
                    tools.as_ref(),
                ),
                false => {
                    kura_api::tools::encode_chat_prompt(codec.as_ref(), messages, tools.as_ref())
                }
            })
            .await
            .map_err(named)?
        }
        (None, None) | (Some(_), Some(_)) => unreachable!("exactly one was checked above"),
    };
    Ok(Json(TokenizeResponse {
        count: tokens.len(),
        tokens,
        max_model_len: s.engine.info().max_model_len,
    }))
}
