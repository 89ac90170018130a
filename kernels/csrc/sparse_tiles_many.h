/* The many-row path of sparse_tiles.c (T > MR rows): a run of a band's tiles expanded
 * once into a per-thread scratch, every block of MR rows multiplied over it. Included by
 * sparse_tiles.c after sparse_tiles.h. */
#ifndef FUSEGEN_SPARSE_TILES_MANY_H
#define FUSEGEN_SPARSE_TILES_MANY_H

/* ---- many rows: a run of tiles expanded once, every row block over it ------------------ */
#if SP_AVX512 || SP_AVX2
/* A thread's scratch, kept for the thread's next calls (grown, never shrunk): the
 * expanded steps of a run of tiles, each step's first channel, where each tile's steps
 * end and its scale, and the sums of every row between runs. */
typedef struct {
    float *steps;    /* [SCRATCH_STEPS][STEP_FLOATS] */
    int32_t *k;      /* [SCRATCH_STEPS] */
    int32_t *ends;   /* [run tiles] */
    float *scale;    /* [run tiles] */
    float *sums;     /* [rows][TILE], in the path's layout */
} scratch_t;

static __thread void *scratch_block;
static __thread size_t scratch_size;

/* this thread's scratch for `rows` rows, or 0 when memory runs out */
static int thread_scratch(scratch_t *s, int64_t rows) {
    const size_t steps = (size_t)SCRATCH_STEPS * STEP_FLOATS * 4, ks = SCRATCH_STEPS * 4,
                 tiles = SCRATCH_STEPS / 32 * 4, sums = (size_t)rows * TILE * 4;
    const size_t need = steps + ks + 2 * tiles + sums;
    if (need > scratch_size) {
        free(scratch_block);
        scratch_size = 0;
        scratch_block = aligned_alloc(64, (need + 63) / 64 * 64);
        if (!scratch_block) return 0;
        scratch_size = need;
    }
    char *p = scratch_block;
    s->steps = (float *)p, s->sums = (float *)(p + steps);
    s->k = (int32_t *)(p + steps + sums), s->ends = (int32_t *)(p + steps + sums + ks);
    s->scale = (float *)(p + steps + sums + ks + tiles);
    return 1;
}

/* one step (its NV vectors w, first channel k) into R rows' sums of a pass */
static inline __attribute__((always_inline)) void
step_rows(const call_t *c, const vec_t w[NV], int64_t k, int64_t r0, const int R,
          vec_t acc[MR][NV], const int DP) {
#if SP_DP
    if (DP) {
        const uint16_t *xb = c->xb + r0 * c->ldxb + k;
        for (int r = 0; r < R; r++) {
            const __m512bh xp = (__m512bh)_mm512_set1_epi32((int)load32(
                (const uint8_t *)(xb + r * c->ldxb)));
            for (int v = 0; v < NV; v++)
                acc[r][v] = _mm512_dpbf16_ps(acc[r][v], (__m512bh)_mm512_castps_si512(w[v]), xp);
        }
        return;
    }
#endif
    const float *x = c->x + r0 * c->ldx + k;
    for (int r = 0; r < R; r++) {
        const vec_t xb = VSET1(x[r * c->ldx]);
        for (int v = 0; v < NV; v++) acc[r][v] = VFMA(w[v], xb, acc[r][v]);
    }
    (void)DP;
}

/* R rows' sums of pass h from `sums` (or zero) into registers, and back */
static inline __attribute__((always_inline)) void
load_sums(vec_t acc[MR][NV], const float *sums, int h, const int R, int zero) {
    for (int r = 0; r < R; r++)
        for (int v = 0; v < NV; v++)
            acc[r][v] = zero ? (vec_t){0} : VLOAD(sums + r * TILE + h * CH + v * VL);
}
static inline __attribute__((always_inline)) void
store_sums(float *sums, vec_t acc[MR][NV], int h, const int R) {
    for (int r = 0; r < R; r++)
        for (int v = 0; v < NV; v++) VSTORE(sums + r * TILE + h * CH + v * VL, acc[r][v]);
}

/* int8: a tile's sums of codes x x (acc) into `sums` with its scale, acc zeroed */
static inline __attribute__((always_inline)) void
fold_tile(float *sums, vec_t acc[MR][NV], float scale, int h, const int R) {
    const vec_t s = VSET1(scale);
    for (int r = 0; r < R; r++)
        for (int v = 0; v < NV; v++) {
            float *p = sums + r * TILE + h * CH + v * VL;
            VSTORE(p, VFMA(acc[r][v], s, VLOAD(p)));
            acc[r][v] = (vec_t){0};
        }
}

/* Tiles [ti0, ti1) of band `to`: their non-empty steps expanded into the scratch in
 * order, and (AVX-512, R > 0) rows [r0, r0 + R) multiplied by each step as it is
 * expanded, so the expansion overlaps their arithmetic; their sums as `rows_over_run`
 * keeps them. Returns the step count. */
static inline __attribute__((always_inline)) int64_t
expand_run(const call_t *c, int64_t to, int64_t ti0, int64_t ti1, scratch_t *s, float *sums,
           int64_t r0, const int R, int first, const int VT, const int DP) {
    vec_t acc[MR][NV];
    load_sums(acc, sums, 0, R, first || VT == V_I8);
    int64_t n = 0;
    for (int64_t ti = ti0; ti < ti1; ti++) {
        const int64_t t = to * c->n_ti + ti, n0 = n;
        int64_t at = c->offsets[t];
        const uint64_t *words = c->bitmap + t * TILE;
        const int cols = c->k - TILE * ti < TILE ? (int)(c->k - TILE * ti) : TILE;
        s->scale[ti - ti0] = VT == V_I8 ? c->scales[t] : 1.0f;
        for (int col = 0; at < c->offsets[t + 1] && col < cols; col += DP ? 2 : 1) {
            const uint64_t w0 = words[col], w1 = DP && col + 1 < cols ? words[col + 1] : 0;
            const int64_t here = at;
            at += popcount64(w0) + popcount64(w1);
            if (!(w0 | w1)) continue;
            float *dst = s->steps + n * STEP_FLOATS;
            const int64_t k = TILE * ti + col;
            /* the values a few steps on, asked for into L1 while this step is used */
            const char *ahead = (const char *)c->values + (here << VALUE_SHIFT(VT)) + 1024;
            _mm_prefetch(ahead, _MM_HINT_T0);
            _mm_prefetch(ahead + 64, _MM_HINT_T0);
#if SP_AVX512
            vec_t w[NV];
#if SP_DP
            if (DP) {
                __m512i pair[4];
                expand_pair(c, w0, w1, here, pair, VT);
                for (int v = 0; v < 4; v++) w[v] = _mm512_castsi512_ps(pair[v]);
            } else
#endif
                expand_step(c, w0, here, w, VT);
            for (int v = 0; v < NV; v++) VSTORE(dst + v * VL, w[v]);
            step_rows(c, w, k, r0, R, acc, DP);
#else
            for (int h = 0; h < TILE / CH; h++) {
                vec_t w[NV];
                expand_pass(c, w0, here, h, w, VT);
                for (int v = 0; v < NV; v++) VSTORE(dst + h * CH + v * VL, w[v]);
            }
#endif
            s->k[n++] = (int32_t)k;
        }
        s->ends[ti - ti0] = (int32_t)n;
        (void)r0;
        if (VT == V_I8 && n > n0) fold_tile(sums, acc, s->scale[ti - ti0], 0, R);
    }
    if (VT != V_I8) store_sums(sums, acc, 0, R);
    return n;
}

/* rows [r0, r0 + R) over a run of `run` tiles expanded in the scratch: their sums start
 * from `sums` (or zero, for the band's first run) and go back there; int8 sums each tile
 * and folds it into `sums` */
static inline __attribute__((always_inline)) void
rows_over_run(const call_t *c, const scratch_t *s, int64_t run, float *sums, int64_t r0,
              const int R, int first, const int VT, const int DP) {
    for (int h = 0; h < TILE / CH; h++) {
        vec_t acc[MR][NV];
        load_sums(acc, sums, h, R, first || VT == V_I8);
        for (int64_t i = 0, n = 0; i < run; i++) {
            for (; n < s->ends[i]; n++) {
                const float *w = s->steps + n * STEP_FLOATS + h * CH;
                vec_t wv[NV];
                for (int v = 0; v < NV; v++) wv[v] = VLOAD(w + v * VL);
                step_rows(c, wv, s->k[n], r0, R, acc, DP);
            }
            if (VT == V_I8 && (i ? s->ends[i - 1] : 0) < s->ends[i])
                fold_tile(sums, acc, s->scale[i], h, R);
        }
        if (VT != V_I8) store_sums(sums, acc, h, R);
    }
}

/* band `to` for rows [r_begin, r_end), in runs of as many tiles as the scratch holds;
 * the first block of rows multiplied as the run is expanded (AVX-512), the others over
 * the scratch; each row's sums (int8: its tiles' scaled sums) wait in the scratch
 * between runs */
static inline __attribute__((always_inline)) void
band_many(const call_t *c, int64_t to, int64_t r_begin, int64_t r_end, scratch_t *s,
          const int VT, const int DP) {
    const int64_t run_tiles = SCRATCH_STEPS / (DP ? TILE / 2 : TILE);
    if (VT == V_I8) memset(s->sums, 0, (size_t)(r_end - r_begin) * TILE * 4);
    for (int64_t ti = 0; ti < c->n_ti; ti += run_tiles) {
        const int64_t ti1 = ti + run_tiles < c->n_ti ? ti + run_tiles : c->n_ti;
        /* rows multiplied while expanding: the first block of MR (AVX-512) */
        const int fused = !SP_AVX512 ? 0 : r_end - r_begin < MR ? (int)(r_end - r_begin) : MR;
#if SP_AVX512
#define EXPAND_CALL(R) expand_run(c, to, ti, ti1, s, s->sums, r_begin, R, ti == 0, VT, DP)
        FOR_ROWS_1_TO_6(fused, EXPAND_CALL)
#undef EXPAND_CALL
#else
        expand_run(c, to, ti, ti1, s, s->sums, r_begin, 0, ti == 0, VT, DP);
#endif
        for (int64_t r0 = r_begin + fused; r0 < r_end; r0 += MR) {
            const int rows = r_end - r0 < MR ? (int)(r_end - r0) : MR;
            float *sums = s->sums + (r0 - r_begin) * TILE;
#define RUN_CALL(R) rows_over_run(c, s, ti1 - ti, sums, r0, R, ti == 0, VT, DP)
            FOR_ROWS_1_TO_6(rows, RUN_CALL)
#undef RUN_CALL
        }
    }
    for (int64_t r0 = r_begin; r0 < r_end; r0 += MR) {
        const int rows = r_end - r0 < MR ? (int)(r_end - r0) : MR;
        store_rows(c, s->sums + (r0 - r_begin) * TILE, TILE, r0, rows, to * TILE,
                   band_rows(c, to * TILE, TILE), LAYOUT(VT, DP));
    }
}
#endif

#endif /* FUSEGEN_SPARSE_TILES_MANY_H */
