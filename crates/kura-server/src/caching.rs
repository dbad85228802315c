//! Context caching shared by the routes: cache TTLs, where a breakpoint falls in the prompt's tokens,
//! and saved contexts (`/v1/caches`), kept in memory and, with a disk tier, as one JSON file each under
//! `<kv-disk-path>/contexts/` so that they outlive the server (their KV blocks are in the disk tier).
//!
//! A saved context is a prompt prefix with an owner (the tenant that made it), a model fingerprint and
//! an expiry on the engine's cache clock. A request that names it (`cached_content`) gets the context's
//! tokens as the start of its prompt and pins them until the context expires; the blocks come from the
//! pool when they are there, else from the lower tiers (promoted on use), else they are computed again.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

pub use kura_api::cache_control::{
    encode_with_breakpoints, join_prefix, lcp, parse_context_ttl, retention_pin, CacheTtl,
    ContextKind, MAX_BREAKPOINTS, MAX_CONTEXT_TTL_S,
};
use kura_api::validate::{template_error, tokenize_error};
use kura_api::ApiError;
use kura_engine::{ChatMessage, EngineHandle, PinSpec, TextCodec};
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Most saved contexts one server keeps, all tenants together (each tenant also has its own quota,
/// `TenantQuotas::contexts`).
pub const MAX_CONTEXTS: usize = 100_000;
/// The most bytes read from one saved context's file: a context is made from a request body (8 MiB
/// at most by default) and its tokens.
const CONTEXT_FILE_MAX_BYTES: u64 = 64 << 20;

/// A saved context: its record in memory and its file on disk.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SavedContext {
    pub id: String,
    pub model: String,
    /// The engine's model fingerprint (weights and KV format) when it was saved.
    pub fingerprint: String,
    /// The owning tenant's cache salt (`None`: the server has no API keys).
    pub tenant: Option<String>,
    pub display_name: Option<String>,
    pub kind: ContextKind,
    pub tokens: Vec<u32>,
    pub created_at_ms: u64,
    pub expires_at_ms: u64,
    /// Whether `tokens` are known to be `kind`'s under this server's tokenizer: true for a context
    /// saved by this process; one read from disk is checked on its first use ([`ContextStore::use_context`]).
    #[serde(skip)]
    pub verified: bool,
}

impl SavedContext {
    /// A new context of `tokens` for the engine's model, owned by `tenant`, living `ttl_s` seconds from
    /// `now_ms` on the cache clock.
    pub fn new(
        info: &kura_engine::EngineInfo,
        tenant: Option<String>,
        display_name: Option<String>,
        kind: ContextKind,
        tokens: Vec<u32>,
        now_ms: u64,
        ttl_s: u64,
    ) -> Self {
        Self {
            id: new_context_id(),
            model: info.model_name.clone(),
            fingerprint: info.model_fingerprint.clone(),
            tenant,
            display_name,
            kind,
            tokens,
            created_at_ms: now_ms,
            expires_at_ms: now_ms.saturating_add(ttl_s.saturating_mul(1000)),
            verified: true,
        }
    }

    /// The request that computes the context's KV: one token generated over it, its blocks pinned and
    /// written through to the lower tiers.
    pub fn build_request(&self) -> kura_engine::GenerateRequest {
        let mut request = kura_engine::GenerateRequest::greedy(self.tokens.clone(), 1);
        request.cache_salt = self.tenant.clone();
        request.pins = vec![self.pin_spec()];
        request
    }

    /// The pin a request using this context asks for: its tokens until it expires, written through to
    /// the lower tiers.
    pub fn pin_spec(&self) -> PinSpec {
        PinSpec {
            tokens: self.tokens.len(),
            expires_at_ms: self.expires_at_ms,
            persist: true,
        }
    }

    /// The API's view of it.
    pub fn to_json(&self) -> Value {
        serde_json::json!({
            "id": self.id,
            "object": "cached_content",
            "model": self.model,
            "display_name": self.display_name,
            "token_count": self.tokens.len(),
            "kind": match self.kind { ContextKind::Messages { .. } => "messages", ContextKind::Prompt { .. } => "prompt" },
            "created_at": self.created_at_ms / 1000,
            "expires_at": self.expires_at_ms / 1000,
        })
    }
}

/// The tokens a saved context stands for: for messages, those the template gives them whatever follows
/// (the common start of the messages alone and of the messages followed by another turn), so that every
/// request that uses it starts with exactly these tokens.
pub fn context_tokens(codec: &dyn TextCodec, kind: &ContextKind) -> Result<Vec<u32>, ApiError> {
    match kind {
        ContextKind::Prompt { text } => codec.encode(text).map_err(tokenize_error),
        ContextKind::Messages { messages } => {
            let alone = codec.encode_chat(messages).map_err(template_error)?;
            let mut more = messages.clone();
            more.push(ChatMessage::new("user", "?"));
            let followed = codec.encode_chat(&more).map_err(template_error)?;
            let n = lcp(&alone, &followed);
            Ok(alone[..n].to_vec())
        }
    }
}

/// Moves a damaged context file aside (`<id>.json.bad`, never served) and says so, with `why`.
fn set_aside(path: &Path, why: &str) -> String {
    let aside = path.with_extension("json.bad");
    let _ = std::fs::rename(path, &aside);
    format!(
        "saved context file {} is damaged ({why}); moved to {}",
        path.display(),
        aside.display()
    )
}

/// The contexts in memory, and the room taken by contexts being written.
#[derive(Debug, Default)]
struct Book {
    map: HashMap<String, SavedContext>,
    /// New contexts whose files are being written, per tenant: counted against the quotas from the
    /// check of room to the insert (or its failure), so that creates at once cannot all pass one
    /// check and together go past a limit.
    reserved: HashMap<Option<String>, usize>,
}

impl Book {
    fn reserved_total(&self) -> usize {
        self.reserved.values().sum()
    }

    /// Gives back one reservation of `tenant`'s.
    fn release(&mut self, tenant: &Option<String>) {
        if let Some(n) = self.reserved.get_mut(tenant) {
            *n -= 1;
            if *n == 0 {
                self.reserved.remove(tenant);
            }
        }
    }
}

/// Every saved context of the server, with their files.
#[derive(Debug)]
pub struct ContextStore {
    dir: Option<PathBuf>,
    contexts: Mutex<Book>,
    /// Most contexts in all: [`MAX_CONTEXTS`] (smaller in tests).
    limit: usize,
    /// Held by each change to an existing context (a new expiry, a deletion, expiry sweeps, owner
    /// moves) from its read to its last write, so that a change never puts back a context another
    /// one has just removed; reads take only `contexts`.
    changes: Mutex<()>,
}

/// Why a saved context could not be used.
fn not_found(id: &str) -> ApiError {
    ApiError::CacheNotFound(id.to_string())
}

impl ContextStore {
    /// A store kept in memory only.
    pub fn in_memory() -> Self {
        Self {
            dir: None,
            contexts: Mutex::new(Book::default()),
            limit: MAX_CONTEXTS,
            changes: Mutex::new(()),
        }
    }

    /// The store of a disk tier's directory: reads every context file (`<dir>/contexts/*.json`);
    /// unreadable ones are reported and set aside as `.bad`, never served. Returns the store and
    /// warnings, one per file set aside.
    pub fn open(disk_dir: &Path) -> Result<(Self, Vec<String>), String> {
        let dir = disk_dir.join("contexts");
        kura_files::make_private_dir(&dir)
            .map_err(|e| format!("could not create {}: {e}", dir.display()))?;
        let mut contexts = HashMap::new();
        let mut warnings = Vec::new();
        let now_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        let latest_expiry = now_ms.saturating_add(MAX_CONTEXT_TTL_S.saturating_mul(1000));
        let entries = std::fs::read_dir(&dir)
            .map_err(|e| format!("could not read {}: {e}", dir.display()))?;
        for entry in entries.flatten() {
            let path = entry.path();
            let name = entry.file_name();
            let tmp_of = name.to_str().and_then(kura_files::atomic_tmp_target);
            if tmp_of.is_some_and(|target| target.ends_with(".json")) {
                // A write cut short by a crash: the context it was for is whole or absent.
                let _ = std::fs::remove_file(&path);
                continue;
            }
            if path.extension().and_then(|e| e.to_str()) != Some("json") {
                continue;
            }
            // The entry's own type: a link here is set aside, not followed to a file elsewhere (a
            // FIFO or a directory is refused by the read below).
            let link = entry.file_type().is_ok_and(|t| t.is_symlink());
            let parsed = match link {
                true => Err(std::io::Error::other("a link, which is not followed")),
                false => kura_files::read(&path, CONTEXT_FILE_MAX_BYTES),
            }
            .map_err(|e| e.to_string())
            .and_then(|b| serde_json::from_slice::<SavedContext>(&b).map_err(|e| e.to_string()))
            .and_then(|c| {
                let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or("");
                if c.id == stem && valid_id(&c.id) {
                    Ok(c)
                } else {
                    Err(format!("its id {:?} does not match its file name", c.id))
                }
            });
            match parsed {
                Ok(mut c) => {
                    // An expiry past the longest TTL from now (an edited file, or one from a clock
                    // far ahead) is brought back to it: no file pins its blocks for ever.
                    c.expires_at_ms = c.expires_at_ms.min(latest_expiry);
                    contexts.insert(c.id.clone(), c);
                }
                Err(e) => warnings.push(set_aside(&path, &e)),
            }
        }
        if contexts.len() > MAX_CONTEXTS {
            // More files than a store holds (copied in from elsewhere): the ones expiring last are
            // served, the others set aside.
            let mut by_expiry: Vec<(u64, String)> = contexts
                .values()
                .map(|c| (c.expires_at_ms, c.id.clone()))
                .collect();
            by_expiry.sort_unstable();
            let extra = contexts.len() - MAX_CONTEXTS;
            for (_, id) in by_expiry.into_iter().take(extra) {
                contexts.remove(&id);
                let path = dir.join(format!("{id}.json"));
                set_aside(&path, "over the store's limit");
            }
            warnings.push(format!(
                "{} holds more than {MAX_CONTEXTS} saved contexts: the {extra} expiring first were \
                 set aside as .bad",
                dir.display()
            ));
        }
        Ok((
            Self {
                dir: Some(dir),
                contexts: Mutex::new(Book {
                    map: contexts,
                    reserved: HashMap::new(),
                }),
                limit: MAX_CONTEXTS,
                changes: Mutex::new(()),
            },
            warnings,
        ))
    }

    fn lock(&self) -> MutexGuard<'_, Book> {
        self.contexts.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The turn to change existing contexts ([`ContextStore::changes`]).
    fn changing(&self) -> MutexGuard<'_, ()> {
        self.changes.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn path_of(&self, id: &str) -> Option<PathBuf> {
        self.dir.as_ref().map(|d| d.join(format!("{id}.json")))
    }

    /// Writes a new context's file, readable by the server's user only (a temporary file renamed into
    /// place). Blocking I/O: callers on an async runtime run it on the blocking pool. A failure is
    /// logged with the file's path and answered without it (507); the file is then absent.
    fn write(&self, c: &SavedContext) -> Result<(), ApiError> {
        let Some(path) = self.path_of(&c.id) else {
            return Ok(());
        };
        let bytes = serialize(c)?;
        kura_files::write_private_atomic(&path, &bytes).map_err(|e| {
            tracing::error!(file = %path.display(), error = %e, "could not write a saved context");
            storage_failed("the saved context could not be stored", &e)
        })
    }

    /// Writes an existing context's file anew (a new expiry, a new owner). `Err` (507): nothing
    /// changed, the old file is in place. `Ok(Some(error))`: the new file is in place but its
    /// directory could not be synced, so a power loss may bring the old one back; the change stands
    /// (removing the new file would lose the context) and the error is for the answer. Blocking I/O.
    fn rewrite(&self, c: &SavedContext) -> Result<Option<ApiError>, ApiError> {
        let Some(path) = self.path_of(&c.id) else {
            return Ok(None);
        };
        let bytes = serialize(c)?;
        match kura_files::replace_private_atomic(&path, &bytes) {
            Ok(()) => Ok(None),
            Err(kura_files::ReplaceError::NotWritten(e)) => {
                tracing::error!(file = %path.display(), error = %e, "could not write a saved context");
                Err(storage_failed("the saved context could not be changed", &e))
            }
            Err(kura_files::ReplaceError::NotSynced(e)) => {
                tracing::error!(file = %path.display(), error = %e,
                    "a saved context was changed, but its directory could not be synced: a power \
                     loss may undo the change");
                Ok(Some(not_durable("the change is in effect", &e)))
            }
        }
    }

    /// Removes context `id`'s file; one already gone is no error. A failure is logged with the path.
    fn remove_file(&self, id: &str) -> std::io::Result<()> {
        let Some(path) = self.path_of(id) else {
            return Ok(());
        };
        match std::fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                tracing::error!(file = %path.display(), error = %e,
                    "could not remove a saved context's file");
                Err(e)
            }
            _ => Ok(()),
        }
    }

    /// Syncs the contexts' directory after removals, so that they outlive a power loss. A failure is
    /// logged.
    fn sync_removals(&self) -> std::io::Result<()> {
        let Some(dir) = &self.dir else {
            return Ok(());
        };
        kura_files::sync_dir(dir).inspect_err(|e| {
            tracing::error!(dir = %dir.display(), error = %e,
                "saved contexts were removed, but their directory could not be synced: a power loss \
                 may bring them back");
        })
    }

    /// Adds a new context (and its file) if its tenant has room under `per_tenant` and the server under
    /// [`MAX_CONTEXTS`]. The room is taken when it is checked, before the file is written, and given
    /// back if the write fails: creates at once never go past a limit together. Blocking I/O.
    pub fn insert(&self, c: SavedContext, per_tenant: usize) -> Result<(), ApiError> {
        {
            let mut book = self.lock();
            self.room(&book, &c.tenant, per_tenant)?;
            *book.reserved.entry(c.tenant.clone()).or_insert(0) += 1;
        }
        let written = self.write(&c);
        let mut book = self.lock();
        book.release(&c.tenant);
        written?;
        book.map.insert(c.id.clone(), c);
        Ok(())
    }

    /// Whether `tenant` may save another context: fewer than `per_tenant` of its own, and fewer than
    /// [`MAX_CONTEXTS`] in all (expired ones not yet dropped, and new ones being written, are
    /// counted). A check ahead of the work of a create; [`Self::insert`] checks again.
    pub fn check_room(&self, tenant: &Option<String>, per_tenant: usize) -> Result<(), ApiError> {
        self.room(&self.lock(), tenant, per_tenant)
    }

    fn room(
        &self,
        book: &Book,
        tenant: &Option<String>,
        per_tenant: usize,
    ) -> Result<(), ApiError> {
        let reserved = book.reserved.get(tenant).copied().unwrap_or(0);
        let mine = book
            .map
            .values()
            .filter(|c| &c.tenant == tenant)
            .count()
            .saturating_add(reserved);
        if mine >= per_tenant {
            return Err(ApiError::QuotaExceeded {
                message: format!(
                    "this API key holds {mine} saved contexts, its limit; delete some (DELETE \
                     /v1/caches/{{id}}) or let them expire"
                ),
                code: "too_many_caches",
            });
        }
        let n = book.map.len().saturating_add(book.reserved_total());
        if n >= self.limit {
            return Err(ApiError::QuotaExceeded {
                message: format!(
                    "this server holds {n} saved contexts, its limit; delete some (DELETE \
                     /v1/caches/{{id}}) or let them expire"
                ),
                code: "too_many_caches",
            });
        }
        Ok(())
    }

    /// Drops every context expired at `now_ms` whose file is removed, and syncs the directory. A
    /// context whose file cannot be removed stays (expired: never served) and is tried again at the
    /// next sweep, rather than come back at the next start while its record is gone. Blocking I/O.
    pub fn expire(&self, now_ms: u64) {
        let _turn = self.changing();
        let due: Vec<String> = self
            .lock()
            .map
            .values()
            .filter(|c| c.expires_at_ms <= now_ms)
            .map(|c| c.id.clone())
            .collect();
        if due.is_empty() {
            return;
        }
        let gone: Vec<&String> = due
            .iter()
            .filter(|id| self.remove_file(id).is_ok())
            .collect();
        let _ = self.sync_removals();
        let mut book = self.lock();
        for id in gone {
            book.map.remove(id);
        }
    }

    /// Moves contexts owned by an old tenant name to its new one (`(old, new)` pairs), rewriting their
    /// files; returns how many moved. Blocking I/O.
    pub fn migrate_owners(&self, renames: &[(String, String)]) -> Result<usize, ApiError> {
        let _turn = self.changing();
        let moved: Vec<SavedContext> = {
            let mut book = self.lock();
            let map = &mut book.map;
            let mut moved = Vec::new();
            for c in map.values_mut() {
                if let Some((_, new)) = renames
                    .iter()
                    .find(|(old, _)| c.tenant.as_ref() == Some(old))
                {
                    c.tenant = Some(new.clone());
                    moved.push(c.clone());
                }
            }
            moved
        };
        // A file in place whose directory sync failed keeps its change (logged).
        for c in &moved {
            self.rewrite(c)?;
        }
        Ok(moved.len())
    }

    /// The live context `id` of `tenant`; another tenant's, an expired or an unknown one is a 404.
    pub fn get(
        &self,
        id: &str,
        tenant: &Option<String>,
        now_ms: u64,
    ) -> Result<SavedContext, ApiError> {
        self.lock()
            .map
            .get(id)
            .filter(|c| &c.tenant == tenant && c.expires_at_ms > now_ms)
            .cloned()
            .ok_or_else(|| not_found(id))
    }

    /// The context `id` for a request: as [`Self::get`], and built for the model the engine serves.
    pub fn use_context(
        &self,
        id: &str,
        tenant: &Option<String>,
        engine: &EngineHandle,
    ) -> Result<SavedContext, ApiError> {
        let c = self.get(id, tenant, engine.cache_now_ms())?;
        let info = engine.info();
        if c.fingerprint != info.model_fingerprint || c.model != info.model_name {
            return Err(ApiError::InvalidRequest {
                message: format!(
                    "saved context {id} was built for model {:?} (fingerprint {}); this server \
                     serves {:?} (fingerprint {}): save it again on this model",
                    c.model, c.fingerprint, info.model_name, info.model_fingerprint
                ),
                param: Some("cached_content"),
                code: Some("cache_model_mismatch"),
            });
        }
        if c.verified {
            return Ok(c);
        }
        // Read from disk: its tokens must be what its text gives (a damaged or edited record would
        // otherwise put other tokens before the request's). Once per context and process.
        if context_tokens(engine.codec().as_ref(), &c.kind)
            .ok()
            .as_ref()
            != Some(&c.tokens)
        {
            // A change's turn: a change to it under way (a new expiry) does not write it back.
            let _turn = self.changing();
            self.lock().map.remove(id);
            if let Some(path) = self.path_of(id) {
                tracing::warn!("{}", set_aside(&path, "its tokens are not its text's"));
            }
            return Err(ApiError::InvalidRequest {
                message: format!(
                    "saved context {id} was damaged on disk (its tokens are not its text's) and has \
                     been set aside: save it again"
                ),
                param: Some("cached_content"),
                code: Some("cache_damaged"),
            });
        }
        if let Some(stored) = self.lock().map.get_mut(id) {
            stored.verified = true;
        }
        Ok(SavedContext {
            verified: true,
            ..c
        })
    }

    /// The live contexts of `tenant`, oldest first.
    pub fn list(&self, tenant: &Option<String>, now_ms: u64) -> Vec<SavedContext> {
        let mut out: Vec<SavedContext> = self
            .lock()
            .map
            .values()
            .filter(|c| &c.tenant == tenant && c.expires_at_ms > now_ms)
            .cloned()
            .collect();
        out.sort_by(|a, b| (a.created_at_ms, &a.id).cmp(&(b.created_at_ms, &b.id)));
        out
    }

    /// Sets a context's expiry. Blocking I/O.
    pub fn set_expiry(
        &self,
        id: &str,
        tenant: &Option<String>,
        now_ms: u64,
        expires_at_ms: u64,
    ) -> Result<Changed, ApiError> {
        let _turn = self.changing();
        let mut c = self.get(id, tenant, now_ms)?;
        c.expires_at_ms = expires_at_ms;
        let not_durable = self.rewrite(&c)?;
        self.lock().map.insert(c.id.clone(), c.clone());
        Ok(Changed {
            context: c,
            not_durable,
        })
    }

    /// Deletes a context (and its file). Blocking I/O.
    pub fn delete(
        &self,
        id: &str,
        tenant: &Option<String>,
        now_ms: u64,
    ) -> Result<Changed, ApiError> {
        let _turn = self.changing();
        let c = self.get(id, tenant, now_ms)?;
        self.remove(c)
    }

    /// Deletes a context whatever its tenant (the operator's `kura cache rm`); `None` if there is no
    /// such context. Blocking I/O.
    pub fn delete_any(&self, id: &str) -> Result<Option<Changed>, ApiError> {
        let _turn = self.changing();
        let Some(c) = self.lock().map.get(id).cloned() else {
            return Ok(None);
        };
        self.remove(c).map(Some)
    }

    /// Removes `c`'s file, then its record, and syncs the directory (the caller holds the changes'
    /// turn). A file that cannot be removed leaves the context as it was (507): gone from memory only,
    /// it would come back at the next start.
    fn remove(&self, c: SavedContext) -> Result<Changed, ApiError> {
        self.remove_file(&c.id).map_err(|e| {
            storage_failed("the saved context could not be deleted; it is kept", &e)
        })?;
        self.lock().map.remove(&c.id);
        let not_durable = self
            .sync_removals()
            .err()
            .map(|e| not_durable("the saved context was deleted", &e));
        Ok(Changed {
            context: c,
            not_durable,
        })
    }

    /// Every context, whatever its tenant or expiry (the operator's `kura cache list`).
    pub fn all(&self) -> Vec<SavedContext> {
        let mut out: Vec<SavedContext> = self.lock().map.values().cloned().collect();
        out.sort_by(|a, b| (a.created_at_ms, &a.id).cmp(&(b.created_at_ms, &b.id)));
        out
    }
}

/// What kind of failure an I/O error is, without any path.
fn io_kind(e: &std::io::Error) -> &'static str {
    match e.raw_os_error() {
        Some(28) => "no space left",
        Some(122) => "disk quota exceeded",
        Some(30) => "read-only file system",
        _ => "input/output error",
    }
}

/// A change made to a saved context ([`ContextStore::set_expiry`], [`ContextStore::delete`]).
#[derive(Debug)]
pub struct Changed {
    /// The context as changed (as it was, for a deletion).
    pub context: SavedContext,
    /// The error to answer with when the change is in effect but its directory could not be synced
    /// afterwards, so that a power loss may undo it (507).
    pub not_durable: Option<ApiError>,
}

fn serialize(c: &SavedContext) -> Result<Vec<u8>, ApiError> {
    serde_json::to_vec(c)
        .map_err(|e| ApiError::Internal(format!("serializing a saved context: {e}")))
}

/// 507 for a failed write or removal (`what` happened, nothing changed), without any path.
fn storage_failed(what: &str, e: &std::io::Error) -> ApiError {
    ApiError::StorageFull(format!(
        "{what}: the server's storage is full or failing ({})",
        io_kind(e)
    ))
}

/// 507 for a change in effect that its storage could not make durable.
fn not_durable(what: &str, e: &std::io::Error) -> ApiError {
    ApiError::StorageFull(format!(
        "{what}, but the server's storage failed to make it durable ({}): a power loss may undo it",
        io_kind(e)
    ))
}

/// A new context id: `ctx_` and [`random_hex96`].
pub fn new_context_id() -> String {
    format!("ctx_{}", random_hex96())
}

/// 24 hex digits of a random 96-bit value (the process's random hasher seeds, the time and a counter,
/// mixed): context and response ids.
pub(crate) fn random_hex96() -> String {
    use std::hash::{BuildHasher, Hasher};
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let mut words = [0u64; 2];
    for (i, w) in words.iter_mut().enumerate() {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(nanos);
        h.write_u64(n);
        h.write_usize(i);
        h.write_u32(std::process::id());
        *w = h.finish();
    }
    format!("{:016x}{:08x}", words[0], words[1] as u32)
}

/// Whether `id` is a well-formed context id (what may name a file).
pub fn valid_id(id: &str) -> bool {
    id.len() == 28
        && id.starts_with("ctx_")
        && id[4..]
            .bytes()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
}

/// Shared handle to the store.
pub type Contexts = Arc<ContextStore>;

#[cfg(test)]
mod tests {
    use super::*;

    fn context(i: usize, tenant: Option<&str>, expires_at_ms: u64) -> SavedContext {
        SavedContext {
            id: format!("ctx_{i:024x}"),
            model: "m".into(),
            fingerprint: "f".into(),
            tenant: tenant.map(String::from),
            display_name: None,
            kind: ContextKind::Prompt { text: "x".into() },
            tokens: vec![1, 2, 3],
            created_at_ms: 0,
            expires_at_ms,
            verified: false,
        }
    }

    #[test]
    fn contexts_belong_to_their_tenant_expire_and_are_bounded() {
        let store = ContextStore::in_memory();
        store.insert(context(1, Some("a"), 1_000), 10).unwrap();
        let a = Some("a".to_string());
        let b = Some("b".to_string());
        assert!(store.get("ctx_000000000000000000000001", &a, 0).is_ok());
        let e = store
            .get("ctx_000000000000000000000001", &b, 0)
            .unwrap_err();
        assert_eq!(e.status().as_u16(), 404);
        assert!(store.list(&b, 0).is_empty());
        assert_eq!(store.list(&a, 0).len(), 1);
        // Past its expiry it is gone.
        assert!(store
            .get("ctx_000000000000000000000001", &a, 1_000)
            .is_err());
        // Each tenant has its own quota: a full one refuses only its own tenant.
        for i in 0..3 {
            store
                .insert(context(i + 10, Some("b"), u64::MAX), 3)
                .unwrap();
        }
        let e = store
            .insert(context(20, Some("b"), u64::MAX), 3)
            .unwrap_err();
        assert_eq!(e.status().as_u16(), 429);
        assert!(e.to_string().contains("this API key holds 3"), "{e}");
        store.insert(context(21, Some("c"), u64::MAX), 3).unwrap();
        assert!(store
            .delete_any(&format!("ctx_{:024x}", 10))
            .unwrap()
            .is_some());
        store.insert(context(20, Some("b"), u64::MAX), 3).unwrap();
    }

    #[test]
    fn creates_at_once_never_go_past_a_quota() {
        let dir = std::env::temp_dir().join(format!("kura-ctx-{}-{}", std::process::id(), line!()));
        let (mut store, _) = ContextStore::open(&dir).unwrap();
        store.limit = 30;
        let store = Arc::new(store);
        // Each create checks for room, writes its file (synced) and enters the context: 60 of them at
        // once, for two tenants of a quota of 20 each on a server that holds 30, used to all pass
        // their checks before any was entered.
        let start = Arc::new(std::sync::Barrier::new(60));
        let creates: Vec<_> = (0..60)
            .map(|i| {
                let (store, start) = (store.clone(), start.clone());
                std::thread::spawn(move || {
                    let tenant = if i % 2 == 0 { "a" } else { "b" };
                    start.wait();
                    store.insert(context(100 + i, Some(tenant), u64::MAX), 20)
                })
            })
            .collect();
        let results: Vec<_> = creates.into_iter().map(|t| t.join().unwrap()).collect();
        let made = results.iter().filter(|r| r.is_ok()).count();
        assert_eq!(made, 30, "the server's limit");
        for e in results.iter().filter_map(|r| r.as_ref().err()) {
            assert_eq!(e.status().as_u16(), 429, "{e}");
        }
        for tenant in ["a", "b"] {
            let n = store.list(&Some(tenant.into()), 0).len();
            assert!(n <= 20, "tenant {tenant} holds {n}");
        }
        let files = std::fs::read_dir(dir.join("contexts")).unwrap().count();
        assert_eq!(files, 30);
        // One tenant alone, under its own quota.
        let (store, _) = ContextStore::open(&dir).unwrap();
        let store = Arc::new(store);
        let start = Arc::new(std::sync::Barrier::new(50));
        let creates: Vec<_> = (0..50)
            .map(|i| {
                let (store, start) = (store.clone(), start.clone());
                std::thread::spawn(move || {
                    start.wait();
                    store
                        .insert(context(200 + i, Some("c"), u64::MAX), 7)
                        .is_ok()
                })
            })
            .collect();
        let made = creates
            .into_iter()
            .map(|t| t.join().unwrap())
            .filter(|&ok| ok)
            .count();
        assert_eq!(made, 7);
        assert_eq!(store.list(&Some("c".into()), 0).len(), 7);
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn a_create_whose_file_cannot_be_written_gives_its_room_back() {
        let dir = std::env::temp_dir().join(format!("kura-ctx-{}-{}", std::process::id(), line!()));
        let (store, _) = ContextStore::open(&dir).unwrap();
        // The directory gone and a file in its place: every write fails.
        std::fs::remove_dir_all(dir.join("contexts")).unwrap();
        std::fs::write(dir.join("contexts"), b"in the way").unwrap();
        let e = store
            .insert(context(1, Some("a"), u64::MAX), 1)
            .unwrap_err();
        assert_eq!(e.status().as_u16(), 507, "{e}");
        assert!(store.all().is_empty());
        std::fs::remove_file(dir.join("contexts")).unwrap();
        std::fs::create_dir(dir.join("contexts")).unwrap();
        store.check_room(&Some("a".into()), 1).unwrap();
        store.insert(context(2, Some("a"), u64::MAX), 1).unwrap();
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn a_context_whose_file_cannot_be_removed_is_kept_not_lost_from_memory_only() {
        let dir = std::env::temp_dir().join(format!("kura-ctx-{}-{}", std::process::id(), line!()));
        let (store, _) = ContextStore::open(&dir).unwrap();
        let tenant = Some("a".to_string());
        let (c1, c2) = (context(1, Some("a"), 5_000), context(2, Some("a"), 5_000));
        let (id1, id2) = (c1.id.clone(), c2.id.clone());
        store.insert(c1, 10).unwrap();
        store.insert(c2, 10).unwrap();
        // A file that cannot be unlinked (a directory, not empty, in its place).
        let file = dir.join("contexts").join(format!("{id1}.json"));
        std::fs::remove_file(&file).unwrap();
        std::fs::create_dir_all(file.join("x")).unwrap();
        let e = store.delete(&id1, &tenant, 0).unwrap_err();
        assert_eq!(e.status().as_u16(), 507, "{e}");
        assert!(e.to_string().contains("could not be deleted"), "{e}");
        assert!(store.get(&id1, &tenant, 0).is_ok(), "kept, as its file is");
        assert!(store.delete_any(&id1).is_err());
        // Expired: the one whose file stays is kept (never served) and tried again at the next sweep.
        store.expire(5_000);
        assert!(store.get(&id1, &tenant, 0).is_ok());
        assert!(store.get(&id1, &tenant, 5_000).is_err(), "expired");
        assert_eq!(store.all().len(), 1);
        assert!(!dir.join("contexts").join(format!("{id2}.json")).exists());
        std::fs::remove_dir_all(&file).unwrap();
        store.expire(5_000);
        assert!(store.all().is_empty());
        // A deletion is in memory and on disk, and stays so at the next start.
        store.insert(context(3, Some("a"), u64::MAX), 10).unwrap();
        let changed = store
            .delete(&format!("ctx_{:024x}", 3), &tenant, 0)
            .unwrap();
        assert!(changed.not_durable.is_none());
        let (again, warnings) = ContextStore::open(&dir).unwrap();
        assert!(warnings.is_empty(), "{warnings:?}");
        assert!(again.all().is_empty());
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn a_context_deleted_while_its_expiry_changes_stays_deleted() {
        let dir = std::env::temp_dir().join(format!("kura-ctx-{}-{}", std::process::id(), line!()));
        let (store, _) = ContextStore::open(&dir).unwrap();
        let store = Arc::new(store);
        let tenant: Option<String> = None;
        // A change of expiry writes the context's file and then its entry; a deletion between the two
        // used to be undone by the entry (and the file) coming back.
        for i in 0..300 {
            let c = context(i, None, u64::MAX);
            let id = c.id.clone();
            store.insert(c, 1_000).unwrap();
            let start = Arc::new(std::sync::Barrier::new(2));
            let patch = {
                let (store, start, id, tenant) =
                    (store.clone(), start.clone(), id.clone(), tenant.clone());
                std::thread::spawn(move || {
                    start.wait();
                    store.set_expiry(&id, &tenant, 0, u64::MAX - 1).is_ok()
                })
            };
            start.wait();
            let deleted = store.delete(&id, &tenant, 0).is_ok();
            let patched = patch.join().unwrap();
            assert!(deleted || patched, "{i}");
            if deleted {
                assert!(store.get(&id, &tenant, 0).is_err(), "context {i} came back");
                let file = dir.join("contexts").join(format!("{id}.json"));
                assert!(!file.exists(), "context {i}'s file came back");
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_file_cannot_pin_its_context_past_the_longest_ttl() {
        let dir = std::env::temp_dir().join(format!("kura-ctx-{}-{}", std::process::id(), line!()));
        let (store, _) = ContextStore::open(&dir).unwrap();
        // As an edited file would say: never expires.
        store.insert(context(7, None, u64::MAX), 10).unwrap();
        drop(store);
        // A write a crash cut short is removed at the next start; other files are left alone.
        let contexts = dir.join("contexts");
        let leftover = contexts.join(format!("ctx_{:024x}.json.4242-3.tmp", 8));
        std::fs::write(&leftover, b"{\"half").unwrap();
        std::fs::write(contexts.join("notes.tmp"), b"mine").unwrap();
        let (again, warnings) = ContextStore::open(&dir).unwrap();
        assert!(warnings.is_empty(), "{warnings:?}");
        assert!(!leftover.exists());
        assert!(contexts.join("notes.tmp").exists());
        let now_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64;
        let loaded = again.lock().map[&format!("ctx_{:024x}", 7)].expires_at_ms;
        assert!(loaded <= now_ms + MAX_CONTEXT_TTL_S * 1000, "{loaded}");
        assert!(
            loaded + 60_000 > now_ms + MAX_CONTEXT_TTL_S * 1000,
            "{loaded}"
        );
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn context_files_are_private_and_owners_migrate() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("kura-ctx-{}-{}", std::process::id(), line!()));
        let (store, _) = ContextStore::open(&dir).unwrap();
        store
            .insert(context(1, Some("key-old"), u64::MAX), 10)
            .unwrap();
        let file = dir.join("contexts").join(format!("ctx_{:024x}.json", 1));
        assert_eq!(
            std::fs::metadata(&file).unwrap().permissions().mode() & 0o777,
            0o600
        );
        let contexts_dir = std::fs::metadata(dir.join("contexts")).unwrap();
        assert_eq!(contexts_dir.permissions().mode() & 0o077, 0);
        let moved = store
            .migrate_owners(&[("key-old".into(), "key-new".into())])
            .unwrap();
        assert_eq!(moved, 1);
        let (again, _) = ContextStore::open(&dir).unwrap();
        assert_eq!(again.all()[0].tenant.as_deref(), Some("key-new"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn ids_name_files_safely() {
        let id = new_context_id();
        assert!(valid_id(&id), "{id}");
        assert_ne!(id, new_context_id());
        for bad in [
            "ctx_../../etc/passwd000000",
            "ctx_ABCDEF0123456789abcdef01",
            "x",
            "",
        ] {
            assert!(!valid_id(bad), "{bad}");
        }
    }
}
