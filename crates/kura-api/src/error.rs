//! Every error the API returns, and the one place where errors become HTTP responses
//! (`IntoResponse for ApiError`). Bodies have OpenAI's shape:
//! `{"error": {"message", "type", "param", "code"}}`. Client errors are logged at debug level, server
//! errors at error level.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use kura_request::{RequestError, SubmitError};
use serde_json::json;

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// A request the client must change: bad JSON, wrong types, values out of range, prompt too long.
    #[error("{message}")]
    InvalidRequest {
        message: String,
        param: Option<&'static str>,
        code: Option<&'static str>,
    },
    #[error("the model `{requested}` does not exist; this server serves `{served}`")]
    ModelNotFound { requested: String, served: String },
    #[error("invalid API key; send `Authorization: Bearer <key>` with one of the server's keys")]
    Unauthorized,
    /// A tenant's key on an operator route.
    #[error("{0} is for the operator key only (--admin-api-key-file); an API key cannot use it")]
    Forbidden(String),
    /// The operator's key on a tenant's route: it names no tenant, so it reads no tenant's cache.
    #[error(
        "{0} takes a tenant's API key (--api-key); the operator key (--admin-api-key-file) cannot use it"
    )]
    TenantOnly(String),
    /// A tenant reached one of its own limits (saved contexts, pins, event streams).
    #[error("{message}")]
    QuotaExceeded { message: String, code: &'static str },
    /// The server could not store what the request asked it to keep (a full or failing disk); the
    /// message never names the server's files.
    #[error("{0}")]
    StorageFull(String),
    #[error("the request body is larger than the limit of {limit_bytes} bytes")]
    BodyTooLarge { limit_bytes: usize },
    #[error("{0}")]
    UnsupportedMediaType(String),
    #[error("the request body did not arrive within the server's limit of {seconds} s")]
    BodyTimeout { seconds: f64 },
    #[error("{0}")]
    QueueFull(String),
    #[error("the server is shutting down and accepts no new requests")]
    ShuttingDown,
    #[error("the request was cancelled because the server's shutdown grace period ended before it finished")]
    CancelledAtShutdown,
    #[error("the inference engine has failed ({0}); the server is stopping")]
    EngineFailed(String),
    #[error(
        "the request did not finish within the server's limit of {seconds} s and was cancelled"
    )]
    Timeout { seconds: u64 },
    /// The client stopped reading a response for longer than the server's stalled-client timeout.
    #[error("{0}")]
    ClientStalled(String),
    #[error("no route for {0}")]
    NotFound(String),
    #[error(
        "no saved context {0:?}: it does not exist, has expired, or belongs to another API key"
    )]
    CacheNotFound(String),
    #[error(
        "no stored response with id {0:?}: it does not exist, was deleted, or belongs to another API key"
    )]
    ResponseNotFound(String),
    #[error("method not allowed: {0}")]
    MethodNotAllowed(String),
    #[error("internal error: {0}")]
    Internal(String),
}

impl ApiError {
    /// The same error, naming `to` where it named the parameter `from` (one check serving two
    /// request shapes).
    pub fn rename_param(self, from: &str, to: &'static str) -> Self {
        match self {
            ApiError::InvalidRequest {
                message,
                param: Some(p),
                code,
            } if p == from => ApiError::InvalidRequest {
                message,
                param: Some(to),
                code,
            },
            other => other,
        }
    }

    /// The same error in another API's name for a field: its parameter, and the field's name where the
    /// message says it as a word (`max_tokens` → `max_output_tokens` for the Responses API).
    pub fn rename_field(self, from: &str, to: &'static str) -> Self {
        match self {
            ApiError::InvalidRequest {
                message,
                param,
                code,
            } => ApiError::InvalidRequest {
                message: replace_word(&message, from, to),
                param: param.map(|p| if p == from { to } else { p }),
                code,
            },
            other => other,
        }
    }

    /// The same error, naming `param` where it named no parameter.
    pub fn with_param(self, param: &'static str) -> Self {
        match self {
            ApiError::InvalidRequest {
                message,
                param: None,
                code,
            } => ApiError::InvalidRequest {
                message,
                param: Some(param),
                code,
            },
            other => other,
        }
    }

    pub fn invalid(message: impl Into<String>, param: Option<&'static str>) -> Self {
        ApiError::InvalidRequest {
            message: message.into(),
            param,
            code: None,
        }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::InvalidRequest { .. } => StatusCode::BAD_REQUEST,
            ApiError::ModelNotFound { .. }
            | ApiError::NotFound(_)
            | ApiError::CacheNotFound(_)
            | ApiError::ResponseNotFound(_) => StatusCode::NOT_FOUND,
            ApiError::Unauthorized => StatusCode::UNAUTHORIZED,
            ApiError::Forbidden(_) | ApiError::TenantOnly(_) => StatusCode::FORBIDDEN,
            ApiError::QuotaExceeded { .. } => StatusCode::TOO_MANY_REQUESTS,
            ApiError::StorageFull(_) => StatusCode::INSUFFICIENT_STORAGE,
            ApiError::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::UnsupportedMediaType(_) => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ApiError::BodyTimeout { .. } | ApiError::ClientStalled(_) => {
                StatusCode::REQUEST_TIMEOUT
            }
            ApiError::CancelledAtShutdown | ApiError::EngineFailed(_) => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            ApiError::QueueFull(_) => StatusCode::TOO_MANY_REQUESTS,
            ApiError::ShuttingDown => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Timeout { .. } => StatusCode::GATEWAY_TIMEOUT,
            ApiError::MethodNotAllowed(_) => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The code a streamed failure reports (the Responses API's `response.failed`): the error's own
    /// code where it has one, else its type (`invalid_request_error`, `server_error`, ...).
    pub fn code_or_type(&self) -> &'static str {
        let (kind, _, code) = self.kind_and_code();
        code.unwrap_or(kind)
    }

    fn kind_and_code(&self) -> (&'static str, Option<&'static str>, Option<&'static str>) {
        match self {
            ApiError::InvalidRequest { param, code, .. } => {
                ("invalid_request_error", *param, *code)
            }
            ApiError::ModelNotFound { .. } => (
                "invalid_request_error",
                Some("model"),
                Some("model_not_found"),
            ),
            ApiError::Unauthorized => ("authentication_error", None, Some("invalid_api_key")),
            ApiError::Forbidden(_) => ("permission_error", None, Some("operator_only")),
            ApiError::TenantOnly(_) => ("permission_error", None, Some("tenant_only")),
            ApiError::QuotaExceeded { code, .. } => ("rate_limit_error", None, Some(*code)),
            ApiError::StorageFull(_) => ("server_error", None, Some("insufficient_storage")),
            ApiError::BodyTooLarge { .. } => {
                ("invalid_request_error", None, Some("request_too_large"))
            }
            ApiError::UnsupportedMediaType(_) => (
                "invalid_request_error",
                None,
                Some("unsupported_media_type"),
            ),
            ApiError::BodyTimeout { .. } => ("invalid_request_error", None, Some("body_timeout")),
            ApiError::ClientStalled(_) => ("timeout_error", None, Some("client_stalled")),
            ApiError::CancelledAtShutdown => (
                "service_unavailable_error",
                None,
                Some("cancelled_at_shutdown"),
            ),
            ApiError::EngineFailed(_) => ("server_error", None, Some("engine_failed")),
            ApiError::QueueFull(_) => ("rate_limit_error", None, Some("queue_full")),
            ApiError::ShuttingDown => ("service_unavailable_error", None, Some("shutting_down")),
            ApiError::Timeout { .. } => ("timeout_error", None, Some("request_timeout")),
            ApiError::NotFound(_) => ("invalid_request_error", None, Some("unknown_url")),
            ApiError::CacheNotFound(_) => (
                "invalid_request_error",
                Some("cached_content"),
                Some("cache_not_found"),
            ),
            ApiError::ResponseNotFound(_) => {
                ("invalid_request_error", None, Some("response_not_found"))
            }
            ApiError::MethodNotAllowed(_) => {
                ("invalid_request_error", None, Some("method_not_allowed"))
            }
            ApiError::Internal(_) => ("server_error", None, None),
        }
    }

    /// The OpenAI-shaped JSON body, also used as the payload of an error event inside an SSE stream.
    pub fn body(&self) -> serde_json::Value {
        let (kind, param, code) = self.kind_and_code();
        json!({"error": {"message": self.to_string(), "type": kind, "param": param, "code": code}})
    }
}

/// `text` with each occurrence of `word` that is not part of a longer name (letters, digits, `_`
/// around it) replaced by `with`.
fn replace_word(text: &str, word: &str, with: &str) -> String {
    let name_char = |c: Option<char>| c.is_some_and(|c| c.is_alphanumeric() || c == '_');
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find(word) {
        let before = if at > 0 {
            rest[..at].chars().next_back()
        } else {
            out.chars().next_back()
        };
        let after = rest[at + word.len()..].chars().next();
        out.push_str(&rest[..at]);
        if name_char(before) || name_char(after) {
            out.push_str(word);
        } else {
            out.push_str(with);
        }
        rest = &rest[at + word.len()..];
    }
    out.push_str(rest);
    out
}

impl From<SubmitError> for ApiError {
    fn from(e: SubmitError) -> Self {
        match e {
            SubmitError::QueueFull { .. } => ApiError::QueueFull(e.to_string()),
            SubmitError::ShuttingDown => ApiError::ShuttingDown,
            SubmitError::EngineFailed(m) => ApiError::EngineFailed(m),
            SubmitError::ContextExceeded { .. } => ApiError::InvalidRequest {
                message: e.to_string(),
                param: Some("max_tokens"),
                code: Some("context_length_exceeded"),
            },
            SubmitError::CannotFit { .. } | SubmitError::CannotFitPages { .. } => {
                ApiError::InvalidRequest {
                    message: e.to_string(),
                    param: Some("max_tokens"),
                    code: Some("kv_cache_capacity_exceeded"),
                }
            }
            SubmitError::PromptTooLong { .. } => ApiError::InvalidRequest {
                message: e.to_string(),
                param: Some("prompt"),
                code: Some("context_length_exceeded"),
            },
            SubmitError::EmptyPrompt | SubmitError::TokenOutOfVocab { .. } => {
                ApiError::invalid(e.to_string(), Some("prompt"))
            }
            SubmitError::ZeroChoices => ApiError::invalid(e.to_string(), Some("n")),
            SubmitError::BiasOutOfVocab { .. } => {
                ApiError::invalid(e.to_string(), Some("logit_bias"))
            }
            SubmitError::AllowedOutOfVocab { .. } => {
                ApiError::invalid(e.to_string(), Some("allowed_token_ids"))
            }
            SubmitError::BadSampling(m) => ApiError::invalid(m, None),
        }
    }
}

impl From<RequestError> for ApiError {
    fn from(e: RequestError) -> Self {
        match e {
            // The request was accepted and then cut at the end of the shutdown grace.
            RequestError::ShuttingDown => ApiError::CancelledAtShutdown,
            RequestError::EngineFailed(m) => ApiError::EngineFailed(m),
            RequestError::CannotFit { .. } | RequestError::CannotFitPages { .. } => {
                ApiError::InvalidRequest {
                    message: e.to_string(),
                    param: Some("max_tokens"),
                    code: Some("kv_cache_capacity_exceeded"),
                }
            }
            // The request's own grammar could go no further (a limit of llguidance's reached while
            // generating): the request's to change, as a grammar refused when it was compiled.
            RequestError::Constraint { param, .. } => ApiError::invalid(e.to_string(), param),
            RequestError::Model(_) => ApiError::Internal(e.to_string()),
            RequestError::ClientStalled { .. } => ApiError::ClientStalled(e.to_string()),
        }
    }
}

/// The fallback of a route that exists for other methods (the server's and the router's): a JSON 405
/// naming the method and path.
pub async fn method_not_allowed(method: axum::http::Method, uri: axum::http::Uri) -> ApiError {
    ApiError::MethodNotAllowed(format!("{method} {}", uri.path()))
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        if matches!(self, ApiError::Internal(_) | ApiError::EngineFailed(_)) {
            tracing::error!(%status, error = %self, "request failed");
        } else {
            tracing::debug!(%status, error = %self, "request rejected");
        }
        let mut response = (status, axum::Json(self.body())).into_response();
        if matches!(self, ApiError::QueueFull(_) | ApiError::ShuttingDown) {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        if matches!(self, ApiError::Unauthorized) {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_error_has_an_openai_body_and_its_status() {
        let cases = [
            (
                ApiError::invalid("bad", Some("n")),
                400,
                "invalid_request_error",
            ),
            (
                ApiError::ModelNotFound {
                    requested: "a".into(),
                    served: "b".into(),
                },
                404,
                "invalid_request_error",
            ),
            (ApiError::Unauthorized, 401, "authentication_error"),
            (
                ApiError::BodyTooLarge { limit_bytes: 1 },
                413,
                "invalid_request_error",
            ),
            (ApiError::QueueFull("full".into()), 429, "rate_limit_error"),
            (ApiError::ShuttingDown, 503, "service_unavailable_error"),
            (ApiError::Timeout { seconds: 3 }, 504, "timeout_error"),
            (ApiError::Internal("x".into()), 500, "server_error"),
            (
                ApiError::UnsupportedMediaType("x".into()),
                415,
                "invalid_request_error",
            ),
            (
                ApiError::BodyTimeout { seconds: 1.0 },
                408,
                "invalid_request_error",
            ),
            (
                ApiError::CancelledAtShutdown,
                503,
                "service_unavailable_error",
            ),
            (ApiError::EngineFailed("x".into()), 503, "server_error"),
        ];
        for (e, status, kind) in cases {
            assert_eq!(e.status().as_u16(), status, "{e}");
            let body = e.body();
            assert_eq!(body["error"]["type"], kind);
            assert_eq!(body["error"]["message"], e.to_string());
        }
        let r = ApiError::QueueFull("full".into()).into_response();
        assert_eq!(r.headers()[header::RETRY_AFTER], "1");
    }

    #[test]
    fn engine_refusals_map_to_client_errors_naming_the_parameter() {
        let e = ApiError::from(SubmitError::ContextExceeded {
            prompt_tokens: 10,
            max_tokens: 20,
            max_model_len: 25,
            excess: 5,
        });
        assert_eq!(e.status(), StatusCode::BAD_REQUEST);
        assert!(e.to_string().contains("5 tokens too many"), "{e}");
        assert_eq!(e.body()["error"]["param"], "max_tokens");
        let e = ApiError::from(SubmitError::QueueFull {
            waiting: 3,
            max_queue: 3,
        });
        assert_eq!(e.status(), StatusCode::TOO_MANY_REQUESTS);
        // A grammar that could not go on while generating names the field it came from.
        let e = ApiError::from(RequestError::Constraint {
            message: "no token allowed".into(),
            param: Some("tools"),
        });
        assert_eq!(e.status(), StatusCode::BAD_REQUEST);
        assert_eq!(e.body()["error"]["param"], "tools");
        assert!(e.to_string().contains("no token allowed"), "{e}");
    }

    #[test]
    fn a_field_is_renamed_in_the_param_and_as_a_word_of_the_message() {
        let e = ApiError::from(SubmitError::ContextExceeded {
            prompt_tokens: 10,
            max_tokens: 100,
            max_model_len: 64,
            excess: 46,
        })
        .rename_field("max_tokens", "max_output_tokens");
        let body = e.body();
        assert_eq!(body["error"]["param"], "max_output_tokens");
        let message = body["error"]["message"].as_str().unwrap();
        assert!(
            message.contains("and max_output_tokens asks for 100 more"),
            "{message}"
        );
        assert!(!message.contains(" max_tokens"), "{message}");
        // Longer names that contain the word are left alone.
        assert_eq!(
            replace_word(
                "max_tokens, max_tokens_x, my_max_tokens (max_tokens)",
                "max_tokens",
                "M"
            ),
            "M, max_tokens_x, my_max_tokens (M)"
        );
        // Other errors and other params are unchanged.
        let e = ApiError::invalid("n must be 1", Some("n")).rename_field("max_tokens", "x");
        assert_eq!(e.body()["error"]["param"], "n");
    }
}
