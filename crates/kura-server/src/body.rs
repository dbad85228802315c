//! The JSON body of a JSON route: checked as `kura_api::body` checks bodies, within the server's limits;
//! and the id in a route's path, whose errors are JSON like every other.

use axum::extract::{FromRequest, FromRequestParts, Path, Request};
use axum::http::request::Parts;
use kura_api::body::{check_json_content_type, parse_json_object, read_body};
use kura_api::ApiError;

use crate::AppState;

/// A JSON object body of a JSON route, checked as this module says.
pub struct JsonBody(pub serde_json::Value);

impl FromRequest<AppState> for JsonBody {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &AppState) -> Result<Self, ApiError> {
        check_json_content_type(req.headers())?;
        let bytes = read_body(req, state, state.body_timeout, state.max_body_bytes).await?;
        parse_json_object(&bytes).map(JsonBody)
    }
}

/// The one id a route's path holds (`/v1/models/{model}`, `/v1/responses/{id}`, …). A path that does
/// not decode (percent-escapes that are not UTF-8, `%ff`) is a 400 in the API's JSON error shape.
pub struct PathId(pub String);

impl<S: Send + Sync> FromRequestParts<S> for PathId {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        match Path::<String>::from_request_parts(parts, state).await {
            Ok(Path(id)) => Ok(PathId(id)),
            Err(rejection) => Err(ApiError::invalid(
                format!("the id in the path: {}", rejection.body_text()),
                None,
            )),
        }
    }
}
