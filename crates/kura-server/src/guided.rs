//! Structured outputs and tool calls on the server side: the model's vocabulary for llguidance (built
//! on the first request that needs it, then shared), a request's grammar compiled on the blocking pool
//! (a grammar llguidance refuses is a 400 naming the problem), and a chat prompt with its tools written
//! in — by the model's own template where it has a tools section, by Kura's fallback format otherwise.

use std::sync::{Arc, OnceLock};

use kura_api::tools::{fallback_messages, native_messages, Guide, ToolFormat, ToolPlan};
use kura_engine::{ChatMessage, ConstraintSpec, EngineHandle};
use kura_guide::Guides;

use crate::error::ApiError;
use crate::handlers::off_the_workers;

/// The model's vocabulary as llguidance reads it, built once (or why it could not be).
pub(crate) type GuidesCell = Arc<OnceLock<Result<Guides, String>>>;

/// How the served model's template writes tool calls, and whether it writes tools itself.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ToolStyle {
    pub format: ToolFormat,
    /// The template has a tools section: tools and tool turns are the template's to render.
    pub native: bool,
}

pub(crate) fn tool_style(engine: &EngineHandle) -> ToolStyle {
    let source = engine.codec().chat_template_source();
    let format = ToolFormat::detect(source);
    ToolStyle {
        format,
        native: format != ToolFormat::Fallback && source.contains("tools"),
    }
}

/// The grammar a chat or completions request's output follows: its tool calls when `tool_choice` asks
/// for one (`required`, a named function), else its output format, compiled for the served model.
pub(crate) async fn constraint(
    engine: &EngineHandle,
    cell: &GuidesCell,
    guide: Option<(Guide, &'static str)>,
    tools: Option<&ToolPlan>,
    style: ToolStyle,
) -> Result<Option<Arc<dyn ConstraintSpec>>, ApiError> {
    let (guide, param) = match tools.and_then(ToolPlan::constrained) {
        Some(defs) => {
            let parallel = tools.is_some_and(|t| t.parallel);
            (
                Guide::Lark(style.format.call_grammar(&defs, parallel)),
                "tools",
            )
        }
        None => match guide {
            Some(g) => g,
            None => return Ok(None),
        },
    };
    let (codec, cell) = (engine.codec().clone(), cell.clone());
    off_the_workers(move || {
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
        Ok(Some(compiled as Arc<dyn ConstraintSpec>))
    })
    .await
}

/// A chat request's messages as the prompt writes them, and the tools the template reads (when it has a
/// tools section and the request has tools).
pub(crate) fn prompt_messages(
    messages: Vec<ChatMessage>,
    tools: Option<&ToolPlan>,
    style: ToolStyle,
) -> (Vec<ChatMessage>, Option<serde_json::Value>) {
    if style.native {
        (native_messages(messages), tools.map(ToolPlan::openai_json))
    } else {
        (fallback_messages(messages, tools), None)
    }
}
