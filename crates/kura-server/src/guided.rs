//! Structured outputs and tool calls on the server side: the model's vocabulary for llguidance (built
//! on the first request that needs it, then shared), a request's grammar compiled on the blocking pool
//! (a grammar llguidance refuses is a 400 naming the problem), two at a time.

use std::sync::{Arc, OnceLock};

use kura_api::tools::{Guide, ToolPlan, ToolStyle};
use kura_engine::{ConstraintSpec, EngineHandle};
use kura_guide::Guides;

use crate::error::ApiError;
use crate::handlers::off_the_workers;

/// The model's vocabulary as llguidance reads it, built once (or why it could not be).
pub(crate) type GuidesCell = Arc<OnceLock<Result<Guides, String>>>;

/// Grammars compiled at once, server-wide.
static COMPILES: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(2);

/// How the served model's template writes tool calls.
pub(crate) fn tool_style(engine: &EngineHandle) -> ToolStyle {
    ToolStyle::of(engine.codec().as_ref())
}

/// The grammar a chat or completions request's output follows: its tool calls when `tool_choice` asks
/// for one (`required`, a named function); calls or an answer in its output format when it has both
/// tools the model may call (`auto`) and a JSON format; else its output format; with no format and
/// a strict tool the model may call, an answer or calls whose strict arguments are valid; compiled
/// for the served model.
pub(crate) async fn constraint(
    engine: &EngineHandle,
    cell: &GuidesCell,
    guide: Option<(Guide, &'static str)>,
    tools: Option<&ToolPlan>,
    style: ToolStyle,
    deadline: crate::output::Deadline,
) -> Result<Option<Arc<dyn ConstraintSpec>>, ApiError> {
    let calls = tools.filter(|t| t.parses_calls());
    // Beside tools the model may call, a format is the answer of a turn that calls none: a JSON one.
    // (A forced call's turn is the call; its format is for a later turn's text, as the OpenAI Agents
    // SDK sends an agent's output type.)
    let answer = match (&guide, calls) {
        (Some((g, param)), Some(_)) => Some(answer_schema(g, param)?),
        _ => None,
    };
    let (guide, param) = match tools.and_then(ToolPlan::constrained) {
        Some(defs) => {
            let parallel = tools.is_some_and(|t| t.parallel);
            (
                Guide::Lark(style.format.call_grammar(&defs, parallel, style.call_token)),
                "tools",
            )
        }
        None => match (guide, calls, answer) {
            // Strict tools the model may call: an answer, or calls held to their schemas.
            (None, Some(plan), _) if plan.strict_under_auto() => (
                Guide::Lark(style.format.call_or_text_grammar(
                    &plan.tools,
                    plan.parallel,
                    style.call_token,
                )),
                "tools",
            ),
            (None, _, _) => return Ok(None),
            // The model may call a tool or answer: the answer alone follows the format.
            (Some((_, param)), Some(plan), Some(schema)) => (
                Guide::Lark(style.format.call_or_json_grammar(
                    &plan.tools,
                    plan.parallel,
                    &schema,
                    style.call_token,
                )),
                param,
            ),
            (Some(g), _, _) => g,
        },
    };
    // Compiles take turns, a few at a time: each holds memory in proportion to its grammar (up to
    // tens of MB), and many at once must not take the machine's memory. The turn goes with the
    // compile: a client that leaves while its grammar compiles drops the wait, not the compile, which
    // keeps its turn until it ends.
    let turn = crate::output::finish_before(deadline, async {
        COMPILES
            .acquire()
            .await
            .map_err(|_| ApiError::Internal("the grammar compiler's queue is closed".into()))
    })
    .await?;
    let (codec, cell) = (engine.codec().clone(), cell.clone());
    // Within the deadline too: past it the request is answered (504) while the compile, which keeps
    // its turn, runs on to its end.
    let compile = off_the_workers(move || {
        let _turn = turn;
        let guides = cell
            .get_or_init(|| Guides::new(codec))
            .as_ref()
            .map_err(|e| {
                ApiError::invalid(
                    format!("structured outputs are not available for this model: {e}"),
                    Some(param),
                )
            })?;
        let compiled = guides.compile(&guide).map_err(|e| {
            ApiError::invalid(
                format!("the {param} grammar could not be compiled: {e}"),
                Some(param),
            )
        })?;
        Ok(Some(Arc::new(FromParam {
            spec: compiled,
            param,
        }) as Arc<dyn ConstraintSpec>))
    });
    crate::output::finish_before(deadline, compile).await
}

/// The schema of an answer in `guide` beside tool calls: JSON only (a regex, a grammar or a choice
/// could not stand beside a call), refused by name otherwise.
fn answer_schema(guide: &Guide, param: &'static str) -> Result<serde_json::Value, ApiError> {
    match guide {
        Guide::JsonObject => Ok(serde_json::json!({"type": "object"})),
        Guide::JsonSchema(schema) => Ok(schema.clone()),
        _ => Err(ApiError::invalid(
            format!(
                "{param} beside tools the model may call must be a JSON schema or json_object: a \
                 call or an answer in that format is what the output can be; send tool_choice none \
                 to answer in this format only"
            ),
            Some(param),
        )),
    }
}

/// A compiled grammar and the request field it came from, which an error met while generating names.
#[derive(Debug)]
struct FromParam<S> {
    spec: Arc<S>,
    param: &'static str,
}

impl<S: ConstraintSpec> ConstraintSpec for FromParam<S> {
    fn start(&self) -> Result<Box<dyn kura_engine::TokenConstraint>, String> {
        self.spec.start()
    }

    fn param(&self) -> Option<&'static str> {
        Some(self.param)
    }
}
