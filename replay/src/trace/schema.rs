//! The trace's Arrow schema (format version 1) and conversions between rows and record batches.
//!
//! One row per request, in arrival order:
//!
//! | column | Arrow type | null | meaning |
//! |---|---|---|---|
//! | `arrival_us` | `UInt64` | no | microseconds since the start of the trace |
//! | `request_id` | `Utf8` | no | the request's id |
//! | `model` | `Utf8` | no | model name |
//! | `input_length` | `UInt32` | no | prompt tokens |
//! | `output_length` | `UInt32` | no | generated tokens |
//! | `block_size` | `UInt32` | no | tokens per block of `block_hashes` |
//! | `block_hashes` | `List<UInt64 not null>` | no | chained prefix id of each prompt block |
//! | `token_ids` | `List<UInt32 not null>` | yes | the prompt, when the recorder kept it |
//! | `session_id` | `Utf8` | yes | conversation / session the request belongs to |
//! | `retention` | `Utf8` | yes | `none`, `ephemeral`, `short` or `long` |
//! | `ttl_seconds` | `UInt32` | yes | requested KV retention time |
//! | `think_time_us` | `UInt64` | yes | a session turn's client think time after its predecessor's answer |
//! | `lora` | `Utf8` | yes | the LoRA adapter the request named (then `model` is its base model) |
//! | `cache_salt` | `Utf8` | yes | the request's `cache_salt` |
//! | `images` | `List<Struct<offset: UInt32, length: UInt32, id: Utf8>>` | yes | the prompt's images: placeholder run and identifier |
//! | `tenant` | `Utf8` | yes | the tenant whose API key sent the request |
//! | `priority` | `Int32` | yes | the priority the request asked for (vLLM's body `priority` or `x-infera-priority`; lower is sooner), before its tenant's floor |
//!
//! The engines key an adapter's, a salted request's or an image's blocks by the adapter, salt or
//! image as well ([`TraceRequest::engine_blocks`]): the replay and the ideal hit rate count them
//! apart. A null `images` is a prompt without images.
//!
//! Readers also accept `LargeUtf8`/`Utf8View` strings and `LargeList` lists (what Polars and
//! DuckDB may write), ignore columns they do not know, and read an absent nullable column as all
//! nulls. Integer types are strict: a column of another width or sign than the table's is an
//! error naming the column, to be cast by the producer (`::UBIGINT`, `::UINTEGER`, `::INTEGER`
//! in DuckDB).
//!
//! File-level facts live in Parquet key-value metadata: [`META_VERSION`] (`"1"`), [`META_SOURCE`]
//! and [`META_NOTES`] (a JSON array of strings).
//!
//! The list helpers ([`primitive_list_array`], [`primitive_lists`], [`list_type`]) are public so
//! that other writers (the replay's `--out`) build list columns the same way.

use super::TraceRequest;
use arrow_array::builder::{ListBuilder, PrimitiveBuilder};
use arrow_array::cast::AsArray;
use arrow_array::types::{Int32Type, UInt32Type, UInt64Type};
use arrow_array::{
    Array, ArrayRef, ArrowPrimitiveType, ListArray, PrimitiveArray, RecordBatch, StringArray,
};
use arrow_schema::{ArrowError, DataType, Field, Schema, SchemaRef};
use infera_core::event::Retention;
use std::fmt;
use std::sync::Arc;

/// The format version this build writes and reads.
pub const TRACE_FORMAT_VERSION: &str = "1";
/// Key-value metadata key holding the format version.
pub const META_VERSION: &str = "infera.trace.version";
/// Key-value metadata key holding [`crate::trace::Trace::source`].
pub const META_SOURCE: &str = "infera.trace.source";
/// Key-value metadata key holding [`crate::trace::Trace::notes`] as a JSON array of strings.
pub const META_NOTES: &str = "infera.trace.notes";

/// Column names.
pub mod col {
    pub const ARRIVAL_US: &str = "arrival_us";
    pub const REQUEST_ID: &str = "request_id";
    pub const MODEL: &str = "model";
    pub const INPUT_LENGTH: &str = "input_length";
    pub const OUTPUT_LENGTH: &str = "output_length";
    pub const BLOCK_SIZE: &str = "block_size";
    pub const BLOCK_HASHES: &str = "block_hashes";
    pub const TOKEN_IDS: &str = "token_ids";
    pub const SESSION_ID: &str = "session_id";
    pub const RETENTION: &str = "retention";
    pub const TTL_SECONDS: &str = "ttl_seconds";
    pub const THINK_TIME_US: &str = "think_time_us";
    pub const LORA: &str = "lora";
    pub const CACHE_SALT: &str = "cache_salt";
    pub const IMAGES: &str = "images";
    pub const TENANT: &str = "tenant";
    pub const PRIORITY: &str = "priority";

    /// Every column, in schema order.
    pub const ALL: [&str; 17] = [
        ARRIVAL_US,
        REQUEST_ID,
        MODEL,
        INPUT_LENGTH,
        OUTPUT_LENGTH,
        BLOCK_SIZE,
        BLOCK_HASHES,
        TOKEN_IDS,
        SESSION_ID,
        RETENTION,
        TTL_SECONDS,
        THINK_TIME_US,
        LORA,
        CACHE_SALT,
        IMAGES,
        TENANT,
        PRIORITY,
    ];
}

/// A problem with one column of a batch; the Parquet reader adds the file name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ColumnError {
    pub column: &'static str,
    /// The row at fault, relative to the batch, when one row is.
    pub row: Option<usize>,
    pub message: String,
}

impl fmt::Display for ColumnError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "column `{}`", self.column)?;
        if let Some(row) = self.row {
            write!(f, ", row {row}")?;
        }
        write!(f, ": {}", self.message)
    }
}

impl std::error::Error for ColumnError {}

fn col_err(column: &'static str, row: Option<usize>, message: impl Into<String>) -> ColumnError {
    ColumnError {
        column,
        row,
        message: message.into(),
    }
}

/// `List<item not null>` of `item`: the type of every list column of the trace.
pub fn list_type(item: DataType) -> DataType {
    DataType::List(Arc::new(Field::new_list_field(item, false)))
}

/// The Arrow schema of format version 1 (no metadata; the writer adds it to the Parquet footer).
pub fn trace_schema() -> SchemaRef {
    use DataType::{UInt32, UInt64, Utf8};
    Arc::new(Schema::new(vec![
        Field::new(col::ARRIVAL_US, UInt64, false),
        Field::new(col::REQUEST_ID, Utf8, false),
        Field::new(col::MODEL, Utf8, false),
        Field::new(col::INPUT_LENGTH, UInt32, false),
        Field::new(col::OUTPUT_LENGTH, UInt32, false),
        Field::new(col::BLOCK_SIZE, UInt32, false),
        Field::new(col::BLOCK_HASHES, list_type(UInt64), false),
        Field::new(col::TOKEN_IDS, list_type(UInt32), true),
        Field::new(col::SESSION_ID, Utf8, true),
        Field::new(col::RETENTION, Utf8, true),
        Field::new(col::TTL_SECONDS, UInt32, true),
        Field::new(col::THINK_TIME_US, UInt64, true),
        Field::new(col::LORA, Utf8, true),
        Field::new(col::CACHE_SALT, Utf8, true),
        Field::new(col::IMAGES, list_type(image_type()), true),
        Field::new(col::TENANT, Utf8, true),
        Field::new(col::PRIORITY, DataType::Int32, true),
    ]))
}

/// The fields of one item of `images`.
fn image_fields() -> arrow_schema::Fields {
    use DataType::{UInt32, Utf8};
    arrow_schema::Fields::from(vec![
        Field::new("offset", UInt32, false),
        Field::new("length", UInt32, false),
        Field::new("id", Utf8, false),
    ])
}

/// The type of one item of `images`.
fn image_type() -> DataType {
    DataType::Struct(image_fields())
}

/// The `images` column of `rows` (null for a prompt without images).
///
/// # Errors
/// When the batch holds more than `i32::MAX` images or id bytes (write fewer rows per batch).
fn images_array(rows: &[TraceRequest]) -> Result<ListArray, ArrowError> {
    use arrow_array::builder::{StringBuilder, StructBuilder, UInt32Builder};
    let images = rows.iter().map(|r| r.images.len()).sum::<usize>();
    let id_bytes = rows
        .iter()
        .flat_map(|r| &r.images)
        .map(|i| i.id.len())
        .sum::<usize>();
    if images.max(id_bytes) > i32::MAX as usize {
        return Err(ArrowError::InvalidArgumentError(format!(
            "the images of one batch ({images} images, {id_bytes} id bytes) exceed Arrow's \
             i32 offsets; write fewer rows per batch"
        )));
    }
    let missing = |field: &str| {
        ArrowError::SchemaError(format!("the images struct has no builder for `{field}`"))
    };
    let items = StructBuilder::new(
        image_fields(),
        vec![
            Box::new(UInt32Builder::new()),
            Box::new(UInt32Builder::new()),
            Box::new(StringBuilder::new()),
        ],
    );
    let mut builder =
        ListBuilder::new(items).with_field(Arc::new(Field::new_list_field(image_type(), false)));
    for r in rows {
        if r.images.is_empty() {
            builder.append_null();
            continue;
        }
        let items = builder.values();
        for image in &r.images {
            items
                .field_builder::<UInt32Builder>(0)
                .ok_or_else(|| missing("offset"))?
                .append_value(image.offset);
            items
                .field_builder::<UInt32Builder>(1)
                .ok_or_else(|| missing("length"))?
                .append_value(image.length);
            items
                .field_builder::<StringBuilder>(2)
                .ok_or_else(|| missing("id"))?
                .append_value(&image.id);
            items.append(true);
        }
        builder.append(true);
    }
    Ok(builder.finish())
}

/// Reads the `images` column (a `List` or `LargeList` of the image struct).
fn images_column(array: &ArrayRef) -> Result<Vec<Vec<super::TraceImage>>, ColumnError> {
    let mismatch = || {
        col_err(
            col::IMAGES,
            None,
            type_mismatch(&list_type(image_type()), array.data_type()),
        )
    };
    let (offsets, values): (Vec<usize>, &ArrayRef) = if let Some(list) = array.as_list_opt::<i32>()
    {
        (
            list.value_offsets().iter().map(|&o| o as usize).collect(),
            list.values(),
        )
    } else if let Some(list) = array.as_list_opt::<i64>() {
        (
            list.value_offsets().iter().map(|&o| o as usize).collect(),
            list.values(),
        )
    } else {
        return Err(mismatch());
    };
    let items = values.as_struct_opt().ok_or_else(mismatch)?;
    let field = |name: &str| items.column_by_name(name).ok_or_else(mismatch);
    let offset = field("offset")?
        .as_primitive_opt::<UInt32Type>()
        .ok_or_else(mismatch)?;
    let length = field("length")?
        .as_primitive_opt::<UInt32Type>()
        .ok_or_else(mismatch)?;
    let ids = strings(col::IMAGES, field("id")?)?;
    let mut out = Vec::with_capacity(array.len());
    for row in 0..array.len() {
        if array.is_null(row) {
            out.push(Vec::new());
            continue;
        }
        let mut images = Vec::with_capacity(offsets[row + 1] - offsets[row]);
        let range = offsets[row]..offsets[row + 1];
        for (i, id) in range.clone().zip(&ids[range]) {
            let id = id.filter(|_| !offset.is_null(i) && !length.is_null(i));
            let id = id.ok_or_else(|| col_err(col::IMAGES, Some(row), "null inside an image"))?;
            images.push(super::TraceImage {
                offset: offset.value(i),
                length: length.value(i),
                id: id.to_owned(),
            });
        }
        out.push(images);
    }
    Ok(out)
}

/// Builds a list column of primitive items from per-row slices (`None` is a null row).
///
/// # Errors
/// If the column would hold more than `i32::MAX` items (split the rows into smaller batches).
pub fn primitive_list_array<'a, T: ArrowPrimitiveType>(
    rows: impl IntoIterator<Item = Option<&'a [T::Native]>>,
) -> Result<ListArray, ArrowError> {
    let mut builder = ListBuilder::new(PrimitiveBuilder::<T>::new())
        .with_field(Arc::new(Field::new_list_field(T::DATA_TYPE, false)));
    let mut total: usize = 0;
    for row in rows {
        match row {
            Some(values) => {
                total = total.saturating_add(values.len());
                if total > i32::MAX as usize {
                    return Err(ArrowError::InvalidArgumentError(format!(
                        "a list column of one batch would hold {total}+ items, more than {}; \
                         write fewer rows per batch",
                        i32::MAX
                    )));
                }
                builder.values().append_slice(values);
                builder.append(true);
            }
            None => builder.append_null(),
        }
    }
    Ok(builder.finish())
}

/// A decoded list column: one `None` (null row) or list of items per row.
pub type ListColumn<N> = Vec<Option<Vec<N>>>;

/// Reads a `List`/`LargeList` column of `T` items into one `Option<Vec<_>>` per row.
///
/// # Errors
/// A message naming the expected and found types, or the first row holding a null item.
pub fn primitive_lists<T: ArrowPrimitiveType>(
    array: &dyn Array,
) -> Result<ListColumn<T::Native>, (Option<usize>, String)> {
    fn rows<T: ArrowPrimitiveType, O: arrow_array::OffsetSizeTrait>(
        list: &arrow_array::GenericListArray<O>,
    ) -> Result<ListColumn<T::Native>, (Option<usize>, String)> {
        let Some(values) = list.values().as_primitive_opt::<T>() else {
            return Err((
                None,
                type_mismatch(&list_type(T::DATA_TYPE), list.data_type()),
            ));
        };
        let offsets = list.value_offsets();
        let mut out = Vec::with_capacity(list.len());
        for row in 0..list.len() {
            if list.is_null(row) {
                out.push(None);
                continue;
            }
            let (start, end) = (offsets[row].as_usize(), offsets[row + 1].as_usize());
            if values.null_count() > 0 && (start..end).any(|i| values.is_null(i)) {
                return Err((Some(row), "null item inside a list".to_owned()));
            }
            out.push(Some(values.values()[start..end].to_vec()));
        }
        Ok(out)
    }
    if let Some(list) = array.as_list_opt::<i32>() {
        rows::<T, i32>(list)
    } else if let Some(list) = array.as_list_opt::<i64>() {
        rows::<T, i64>(list)
    } else {
        Err((
            None,
            type_mismatch(&list_type(T::DATA_TYPE), array.data_type()),
        ))
    }
}

fn type_mismatch(expected: &DataType, found: &DataType) -> String {
    format!("expected type {expected}, found {found}; cast the column when producing the file")
}

/// Converts rows to a record batch of [`trace_schema`].
///
/// # Errors
/// Only when a list or string column of the batch would exceed Arrow's `i32` offsets (more than
/// 2^31 items); write fewer rows per batch.
pub fn to_record_batch(rows: &[TraceRequest]) -> Result<RecordBatch, ArrowError> {
    let total_str: usize = rows
        .iter()
        .map(|r| r.request_id.len() + r.model.len() + r.session_id.as_ref().map_or(0, String::len))
        .sum();
    if total_str > i32::MAX as usize {
        return Err(ArrowError::InvalidArgumentError(
            "string columns of one batch exceed 2 GiB; write fewer rows per batch".to_owned(),
        ));
    }
    let columns: Vec<ArrayRef> = vec![
        Arc::new(PrimitiveArray::<UInt64Type>::from_iter_values(
            rows.iter().map(|r| r.arrival_us),
        )),
        Arc::new(StringArray::from_iter_values(
            rows.iter().map(|r| r.request_id.as_str()),
        )),
        Arc::new(StringArray::from_iter_values(
            rows.iter().map(|r| r.model.as_str()),
        )),
        Arc::new(PrimitiveArray::<UInt32Type>::from_iter_values(
            rows.iter().map(|r| r.input_length),
        )),
        Arc::new(PrimitiveArray::<UInt32Type>::from_iter_values(
            rows.iter().map(|r| r.output_length),
        )),
        Arc::new(PrimitiveArray::<UInt32Type>::from_iter_values(
            rows.iter().map(|r| r.block_size),
        )),
        Arc::new(primitive_list_array::<UInt64Type>(
            rows.iter().map(|r| Some(r.block_hashes.as_slice())),
        )?),
        Arc::new(primitive_list_array::<UInt32Type>(
            rows.iter().map(|r| r.token_ids.as_deref()),
        )?),
        Arc::new(StringArray::from_iter(
            rows.iter().map(|r| r.session_id.as_deref()),
        )),
        Arc::new(StringArray::from_iter(
            rows.iter().map(|r| r.retention.map(Retention::as_str)),
        )),
        Arc::new(PrimitiveArray::<UInt32Type>::from_iter(
            rows.iter().map(|r| r.ttl_seconds),
        )),
        Arc::new(PrimitiveArray::<UInt64Type>::from_iter(
            rows.iter().map(|r| r.think_time_us),
        )),
        Arc::new(StringArray::from_iter(
            rows.iter().map(|r| r.lora.as_deref()),
        )),
        Arc::new(StringArray::from_iter(
            rows.iter().map(|r| r.cache_salt.as_deref()),
        )),
        Arc::new(images_array(rows)?),
        Arc::new(StringArray::from_iter(
            rows.iter().map(|r| r.tenant.as_deref()),
        )),
        Arc::new(PrimitiveArray::<Int32Type>::from_iter(
            rows.iter().map(|r| r.priority),
        )),
    ];
    RecordBatch::try_new(trace_schema(), columns)
}

/// Whether a column of this name may have this type (see the module table).
fn accepts(column: &str, dt: &DataType) -> bool {
    let string = matches!(
        dt,
        DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View
    );
    let list_of = |item: &DataType| match dt {
        DataType::List(f) | DataType::LargeList(f) => f.data_type() == item,
        _ => false,
    };
    match column {
        col::ARRIVAL_US | col::THINK_TIME_US => *dt == DataType::UInt64,
        col::REQUEST_ID
        | col::MODEL
        | col::SESSION_ID
        | col::RETENTION
        | col::LORA
        | col::CACHE_SALT
        | col::TENANT => string,
        col::INPUT_LENGTH | col::OUTPUT_LENGTH | col::BLOCK_SIZE | col::TTL_SECONDS => {
            *dt == DataType::UInt32
        }
        col::PRIORITY => *dt == DataType::Int32,
        col::BLOCK_HASHES => list_of(&DataType::UInt64),
        col::IMAGES => matches!(dt, DataType::List(f) | DataType::LargeList(f)
            if matches!(f.data_type(), DataType::Struct(_))),
        col::TOKEN_IDS => list_of(&DataType::UInt32),
        _ => true,
    }
}

/// Checks that every required column is present and every known column has an accepted type.
///
/// # Errors
/// The first missing or mistyped column, in schema order.
pub fn check_schema(schema: &Schema) -> Result<(), ColumnError> {
    let expected = trace_schema();
    for (name, want) in col::ALL.into_iter().zip(expected.fields().iter()) {
        match schema.field_with_name(name) {
            Ok(found) if accepts(name, found.data_type()) => {}
            Ok(found) => {
                return Err(col_err(
                    name,
                    None,
                    type_mismatch(want.data_type(), found.data_type()),
                ));
            }
            Err(_) if want.is_nullable() => {}
            Err(_) => {
                return Err(col_err(
                    name,
                    None,
                    format!("missing required column of type {}", want.data_type()),
                ));
            }
        }
    }
    Ok(())
}

fn required<'a>(batch: &'a RecordBatch, name: &'static str) -> Result<&'a ArrayRef, ColumnError> {
    let array = batch
        .column_by_name(name)
        .ok_or_else(|| col_err(name, None, "missing required column"))?;
    if array.null_count() > 0 {
        let row = (0..array.len()).find(|&i| array.is_null(i));
        return Err(col_err(name, row, "null in a required column"));
    }
    Ok(array)
}

fn primitive<'a, T: ArrowPrimitiveType>(
    name: &'static str,
    array: &'a ArrayRef,
) -> Result<&'a PrimitiveArray<T>, ColumnError> {
    array
        .as_primitive_opt::<T>()
        .ok_or_else(|| col_err(name, None, type_mismatch(&T::DATA_TYPE, array.data_type())))
}

fn strings<'a>(
    name: &'static str,
    array: &'a ArrayRef,
) -> Result<Vec<Option<&'a str>>, ColumnError> {
    if let Some(a) = array.as_string_opt::<i32>() {
        Ok(a.iter().collect())
    } else if let Some(a) = array.as_string_opt::<i64>() {
        Ok(a.iter().collect())
    } else if let Some(a) = array.as_string_view_opt() {
        Ok(a.iter().collect())
    } else {
        Err(col_err(
            name,
            None,
            type_mismatch(&DataType::Utf8, array.data_type()),
        ))
    }
}

fn lists<T: ArrowPrimitiveType>(
    name: &'static str,
    array: &ArrayRef,
) -> Result<ListColumn<T::Native>, ColumnError> {
    primitive_lists::<T>(array.as_ref()).map_err(|(row, message)| col_err(name, row, message))
}

/// Converts a record batch back to rows. The inverse of [`to_record_batch`], and tolerant of the
/// variations listed in the module docs.
///
/// # Errors
/// A [`ColumnError`] naming the column (and row, relative to the batch) that is missing, mistyped,
/// null where it must not be, or holds an unknown retention class.
pub fn from_record_batch(batch: &RecordBatch) -> Result<Vec<TraceRequest>, ColumnError> {
    let n = batch.num_rows();
    let arrival = primitive::<UInt64Type>(col::ARRIVAL_US, required(batch, col::ARRIVAL_US)?)?;
    let request_id = strings(col::REQUEST_ID, required(batch, col::REQUEST_ID)?)?;
    let model = strings(col::MODEL, required(batch, col::MODEL)?)?;
    let input = primitive::<UInt32Type>(col::INPUT_LENGTH, required(batch, col::INPUT_LENGTH)?)?;
    let output = primitive::<UInt32Type>(col::OUTPUT_LENGTH, required(batch, col::OUTPUT_LENGTH)?)?;
    let block_size = primitive::<UInt32Type>(col::BLOCK_SIZE, required(batch, col::BLOCK_SIZE)?)?;
    let hashes = lists::<UInt64Type>(col::BLOCK_HASHES, required(batch, col::BLOCK_HASHES)?)?;

    let optional = |name| batch.column_by_name(name);
    let tokens = match optional(col::TOKEN_IDS) {
        Some(a) => lists::<UInt32Type>(col::TOKEN_IDS, a)?,
        None => vec![None; n],
    };
    let session = match optional(col::SESSION_ID) {
        Some(a) => strings(col::SESSION_ID, a)?,
        None => vec![None; n],
    };
    let retention = match optional(col::RETENTION) {
        Some(a) => strings(col::RETENTION, a)?,
        None => vec![None; n],
    };
    let ttl: Vec<Option<u32>> = match optional(col::TTL_SECONDS) {
        Some(a) => primitive::<UInt32Type>(col::TTL_SECONDS, a)?
            .iter()
            .collect(),
        None => vec![None; n],
    };
    let lora = match optional(col::LORA) {
        Some(a) => strings(col::LORA, a)?,
        None => vec![None; n],
    };
    let salt = match optional(col::CACHE_SALT) {
        Some(a) => strings(col::CACHE_SALT, a)?,
        None => vec![None; n],
    };
    let tenant = match optional(col::TENANT) {
        Some(a) => strings(col::TENANT, a)?,
        None => vec![None; n],
    };
    let priority: Vec<Option<i32>> = match optional(col::PRIORITY) {
        Some(a) => primitive::<Int32Type>(col::PRIORITY, a)?.iter().collect(),
        None => vec![None; n],
    };
    let mut images = match optional(col::IMAGES) {
        Some(a) => images_column(a)?,
        None => vec![Vec::new(); n],
    }
    .into_iter();
    let think: Vec<Option<u64>> = match optional(col::THINK_TIME_US) {
        Some(a) => primitive::<UInt64Type>(col::THINK_TIME_US, a)?
            .iter()
            .collect(),
        None => vec![None; n],
    };

    let mut out = Vec::with_capacity(n);
    let mut hashes = hashes.into_iter();
    let mut tokens = tokens.into_iter();
    for row in 0..n {
        let retention = match retention[row] {
            None => None,
            Some(s) => Some(Retention::parse(s).ok_or_else(|| {
                col_err(
                    col::RETENTION,
                    Some(row),
                    format!("unknown retention {s:?}; expected none, ephemeral, short or long"),
                )
            })?),
        };
        out.push(TraceRequest {
            arrival_us: arrival.value(row),
            request_id: request_id[row].unwrap_or_default().to_owned(),
            model: model[row].unwrap_or_default().to_owned(),
            input_length: input.value(row),
            output_length: output.value(row),
            block_size: block_size.value(row),
            block_hashes: hashes.next().flatten().unwrap_or_default(),
            token_ids: tokens.next().flatten(),
            session_id: session[row].map(str::to_owned),
            retention,
            ttl_seconds: ttl[row],
            think_time_us: think[row],
            lora: lora[row].map(str::to_owned),
            cache_salt: salt[row].map(str::to_owned),
            images: images.next().unwrap_or_default(),
            tenant: tenant[row].map(str::to_owned),
            priority: priority[row],
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow_array::Int64Array;

    fn row(i: u64) -> TraceRequest {
        TraceRequest {
            arrival_us: i,
            request_id: format!("r{i}"),
            model: "m".into(),
            input_length: 3,
            output_length: 2,
            block_size: 2,
            block_hashes: vec![i, i + 1],
            token_ids: i.is_multiple_of(2).then(|| vec![1, 2, 3]),
            session_id: i.is_multiple_of(3).then(|| "s".to_owned()),
            retention: (i % 2 == 1).then_some(Retention::Short),
            ttl_seconds: (i % 2 == 1).then_some(60),
            think_time_us: i.is_multiple_of(2).then_some(i * 1_000),
            lora: i.is_multiple_of(3).then(|| format!("adapter-{i}")),
            cache_salt: (i % 4 == 1).then(|| format!("tenant-{i}")),
            images: (0..i % 3)
                .map(|k| super::super::TraceImage {
                    offset: 3 + k as u32 * 2000,
                    length: 1024,
                    id: format!("sha256-{i}{k}"),
                })
                .collect(),
            tenant: (i % 5 == 2).then(|| format!("team-{}", i % 2)),
            priority: (i % 3 == 1).then_some(i as i32 - 4),
        }
    }

    #[test]
    fn batch_round_trip_keeps_nulls_and_lists() {
        let rows: Vec<_> = (0..5).map(row).collect();
        let batch = to_record_batch(&rows).expect("batch");
        assert_eq!(batch.schema(), trace_schema());
        assert_eq!(from_record_batch(&batch).expect("rows"), rows);
    }

    #[test]
    fn schema_check_names_missing_and_mistyped_columns() {
        let mut fields: Vec<Field> = trace_schema()
            .fields()
            .iter()
            .map(|f| f.as_ref().clone())
            .collect();
        fields.retain(|f| f.name() != col::MODEL);
        let err = check_schema(&Schema::new(fields.clone())).expect_err("missing");
        assert_eq!(err.column, col::MODEL);

        fields.retain(|f| f.name() != col::TOKEN_IDS);
        fields.push(Field::new(col::MODEL, DataType::LargeUtf8, false));
        assert!(
            check_schema(&Schema::new(fields.clone())).is_ok(),
            "optional may be absent"
        );

        fields.retain(|f| f.name() != col::ARRIVAL_US);
        fields.push(Field::new(col::ARRIVAL_US, DataType::Int64, false));
        let err = check_schema(&Schema::new(fields)).expect_err("mistyped");
        assert_eq!(err.column, col::ARRIVAL_US);
        assert!(err.to_string().contains("Int64"), "{err}");
    }

    #[test]
    fn wrong_column_type_in_batch_is_named() {
        let rows: Vec<_> = (0..2).map(row).collect();
        let batch = to_record_batch(&rows).expect("batch");
        let mut columns = batch.columns().to_vec();
        let mut fields: Vec<Field> = batch
            .schema()
            .fields()
            .iter()
            .map(|f| f.as_ref().clone())
            .collect();
        columns[0] = Arc::new(Int64Array::from(vec![1, 2]));
        fields[0] = Field::new(col::ARRIVAL_US, DataType::Int64, false);
        let bad = RecordBatch::try_new(Arc::new(Schema::new(fields)), columns).expect("bad batch");
        let err = from_record_batch(&bad).expect_err("wrong type");
        assert_eq!(err.column, col::ARRIVAL_US);
    }

    #[test]
    fn unknown_retention_is_an_error_with_row() {
        let rows: Vec<_> = (0..3).map(row).collect();
        let batch = to_record_batch(&rows).expect("batch");
        let mut columns = batch.columns().to_vec();
        columns[9] = Arc::new(StringArray::from(vec![
            None,
            Some("short"),
            Some("forever"),
        ]));
        let bad = RecordBatch::try_new(batch.schema(), columns).expect("bad batch");
        let err = from_record_batch(&bad).expect_err("bad retention");
        assert_eq!((err.column, err.row), (col::RETENTION, Some(2)));
    }
}
