SELECT model,
       worker,
       hour,
       CAST(COUNT(*) AS BIGINT) AS requests,
       CAST(SUM(tokens_in) AS BIGINT) AS prompt_tokens,
       CAST(SUM(cached_tokens) AS BIGINT) AS cached_tokens,
       CAST(SUM(cached_tokens) AS DOUBLE PRECISION)
           / NULLIF(SUM(CASE WHEN cached_tokens IS NOT NULL THEN tokens_in END), 0) AS hit_rate,
       CAST(SUM(overlap_blocks) AS DOUBLE PRECISION)
           / NULLIF(SUM(request_blocks), 0) AS predicted_hit_rate
FROM requests
WHERE finished_seq IS NOT NULL
GROUP BY model, worker, hour
ORDER BY model, worker, hour
