/* One call per image: JPEG -> crop box -> antialiased bilinear resize -> flip -> CHW uint8 or
 * normalised float32, written straight into the caller's buffer.
 *
 * Why our own C instead of PIL or simplejpeg: neither can decode only a region. libjpeg-turbo
 * can: jpeg_crop_scanline skips the inverse DCT and colour conversion of the columns left and
 * right of the box, jpeg_skip_scanlines those of the rows above it, and decoding stops at the
 * box's last row. On top, the smallest DCT scale (1/2, 1/4, 1/8) that keeps the box at least
 * `size` pixels is used, and the resample writes the output layout directly, so there is no
 * full-size RGB image, no HWC -> CHW transpose and no separate normalise pass.
 *
 * The resample is the same filter as PIL's BILINEAR with `box=` (a triangle filter widened by
 * the downscale factor, taps clamped to the image, 22-bit fixed point), done vertical-first so
 * the inner loop runs over contiguous bytes; results differ from PIL's by rounding only.
 *
 * Bounds: the caller (header.py) has already refused images over its pixel limit, with too many
 * scans or needing too much memory; this file refuses them again, for callers of decode_into:
 * - work: a progressive JPEG costs one pass over all its coefficients per scan, and a scan can
 *   cost under 100 bytes, so repeating one makes a 400 KB file decode for minutes (measured: a
 *   one-colour 8000x8000 file, 10 scans 0.7 s, 100 scans 13 s, 500 scans 82 s). libjpeg calls
 *   its progress monitor for every iMCU row it consumes; ours stops the decode as soon as a scan
 *   past `max_scans` starts, as TurboJPEG's scan limit does.
 * - memory: a progressive (or multi-scan) JPEG keeps every coefficient of the whole image,
 *   128 bytes per 8x8 block (a 9400x9400 4:4:4 file: 505 MiB), whatever region we decode. Those
 *   buffers plus our decoded region must fit `max_memory`, checked from the header before
 *   anything is allocated; libjpeg's own max_memory_to_use is set to it too, so a buffer we did
 *   not foresee fails in libjpeg ("no backing store") instead of growing.
 * - the decoded region: at most MAX_REGION_PIXELS; the output side at most MAX_OUTPUT_SIDE.
 * Every libjpeg error is caught (setjmp) and returned as a message, never a crash. Corrupt-data
 * warnings are recovered from, as PIL and DALI do. The GIL is released for the whole decode.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <setjmp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jpeglib.h>
#include <jerror.h>

#ifdef __SSE2__
#include <emmintrin.h>
#endif

/* 14-bit taps fit int16, so two taps multiply-add in one SSE2 instruction (pmaddwd). */
#define PRECISION_BITS 14
#define MAX_REGION_PIXELS (1u << 28)
#define MAX_OUTPUT_SIDE 8192 /* scratch grows with size x region width */
/* The defaults of header.py's DEFAULT_MAX_SCANS and DEFAULT_MAX_MEMORY (cpu.py always passes its own). */
#define DEFAULT_MAX_SCANS 64
#define DEFAULT_MAX_MEMORY (320LL << 20)

typedef struct {
    struct jpeg_error_mgr pub;
    jmp_buf jump;
    int refused; /* a limit of ours stopped the decode: `message` says which */
    char message[JMSG_LENGTH_MAX + 64];
} ErrorManager;

/* libjpeg calls this for every iMCU row it consumes (and every scan header it reads). */
typedef struct {
    struct jpeg_progress_mgr pub;
    int max_scans; /* 0: no limit */
    ErrorManager *err;
} ScanLimit;

static void on_error(j_common_ptr cinfo) {
    ErrorManager *err = (ErrorManager *)cinfo->err;
    (*cinfo->err->format_message)(cinfo, err->message);
    longjmp(err->jump, 1);
}

static void on_message(j_common_ptr cinfo, int level) {
    if (level < 0) cinfo->err->num_warnings++; /* recover from corrupt data; say nothing */
}

static void on_progress(j_common_ptr cinfo) {
    ScanLimit *limit = (ScanLimit *)cinfo->progress;
    const int scan = ((j_decompress_ptr)cinfo)->input_scan_number;
    if (limit->max_scans > 0 && scan > limit->max_scans) {
        snprintf(limit->err->message, sizeof limit->err->message,
                 "JPEG with more than %d scans (max_scans): each costs a pass over the whole image",
                 limit->max_scans);
        limit->err->refused = 1;
        longjmp(limit->err->jump, 1);
    }
}

/* Bytes libjpeg holds for the whole image's coefficients when it must buffer them (progressive
 * or multi-scan files; jdcoefct.c's virtual arrays: blocks rounded up to whole iMCUs, 64 JCOEFs
 * a block); 0 when it decodes in one pass. Valid after jpeg_read_header. */
static size_t coefficient_bytes(j_decompress_ptr cinfo) {
    if (!jpeg_has_multiple_scans(cinfo)) return 0;
    size_t total = 0;
    for (int c = 0; c < cinfo->num_components; c++) {
        const jpeg_component_info *comp = &cinfo->comp_info[c];
        const size_t h = (size_t)comp->h_samp_factor, v = (size_t)comp->v_samp_factor;
        const size_t bw = ((size_t)comp->width_in_blocks + h - 1) / h * h;
        const size_t bh = ((size_t)comp->height_in_blocks + v - 1) / v * v;
        total += bw * bh * sizeof(JBLOCK);
    }
    return total;
}

/* Per-thread scratch, grown on demand: a fresh malloc of a few hundred KiB per image would be an
 * mmap + page faults every call. */
typedef struct {
    uint8_t *region;   /* decoded rows of the box (plus filter margin), RGBX */
    size_t region_cap;
    uint8_t *vpass;    /* after the vertical pass: size rows x region width, RGBX */
    uint8_t *hpass;    /* one output row, RGBX */
    size_t hpass_cap;
    size_t vpass_cap;
    JSAMPROW *rows;
    size_t rows_cap;
    int16_t *coef;     /* filter taps of both axes */
    size_t coef_cap;
    int *bounds;
    size_t bounds_cap;
    double *weights;
    size_t weights_cap;
} Scratch;

static __thread Scratch scratch;

static int grow(void **buf, size_t *cap, size_t need) {
    if (need <= *cap) return 1;
    void *p = realloc(*buf, need);
    if (p == NULL) return 0;
    *buf = p;
    *cap = need;
    return 1;
}

static inline double triangle(double x) {
    if (x < 0.0) x = -x;
    return x < 1.0 ? 1.0 - x : 0.0;
}

static inline uint8_t clip8(int32_t v) {
    v >>= PRECISION_BITS;
    return v < 0 ? 0 : (v > 255 ? 255 : (uint8_t)v);
}

/* Taps mapping `out_size` outputs onto the source span starting at `in0`, `scale` source pixels
 * per output, of an axis of `in_size` pixels: output i reads bounds[2i] .. bounds[2i] +
 * bounds[2i+1] - 1 with weights coef[i*ksize ..]. */
static void taps(double in0, double scale, int in_size, int out_size, int ksize, int *bounds, int16_t *coef,
                 double *weights) {
    double filterscale = scale < 1.0 ? 1.0 : scale;
    double support = filterscale; /* the triangle's support is 1 */
    for (int i = 0; i < out_size; i++) {
        double center = in0 + (i + 0.5) * scale;
        int lo = (int)(center - support + 0.5);
        int hi = (int)(center + support + 0.5);
        if (lo < 0) lo = 0;
        if (hi > in_size) hi = in_size;
        if (hi - lo > ksize) hi = lo + ksize;
        int n = hi - lo;
        double total = 0.0;
        for (int k = 0; k < n; k++) {
            weights[k] = triangle((k + lo - center + 0.5) / filterscale);
            total += weights[k];
        }
        for (int k = 0; k < ksize; k++) {
            double w = (k < n && total != 0.0) ? weights[k] / total : 0.0;
            coef[i * ksize + k] = (int16_t)(w * (1 << PRECISION_BITS) + (w < 0 ? -0.5 : 0.5));
        }
        bounds[2 * i] = lo;
        bounds[2 * i + 1] = n;
    }
}

static inline int kernel_size(double scale) { return (int)ceil(scale < 1.0 ? 1.0 : scale) * 2 + 1; }

/* dst[j] = sum_t rows[t][j] * k[t], for j < len: one output row of the vertical pass. */
static void vertical_row(const uint8_t *const *rows, const int16_t *k, int n, size_t len, uint8_t *dst) {
    size_t j = 0;
#ifdef __SSE2__
    const __m128i zero = _mm_setzero_si128();
    const __m128i round = _mm_set1_epi32(1 << (PRECISION_BITS - 1));
    for (; j + 16 <= len; j += 16) {
        __m128i a0 = round, a1 = round, a2 = round, a3 = round;
        for (int t = 0; t < n; t += 2) {
            const int pair = t + 1 < n;
            const __m128i w = _mm_set1_epi32((int)((uint16_t)k[t] | ((uint32_t)(uint16_t)(pair ? k[t + 1] : 0) << 16)));
            const __m128i p = _mm_loadu_si128((const __m128i *)(rows[t] + j));
            const __m128i q = pair ? _mm_loadu_si128((const __m128i *)(rows[t + 1] + j)) : zero;
            const __m128i lo = _mm_unpacklo_epi8(p, q), hi = _mm_unpackhi_epi8(p, q); /* p0 q0 p1 q1 .. */
            a0 = _mm_add_epi32(a0, _mm_madd_epi16(_mm_unpacklo_epi8(lo, zero), w));
            a1 = _mm_add_epi32(a1, _mm_madd_epi16(_mm_unpackhi_epi8(lo, zero), w));
            a2 = _mm_add_epi32(a2, _mm_madd_epi16(_mm_unpacklo_epi8(hi, zero), w));
            a3 = _mm_add_epi32(a3, _mm_madd_epi16(_mm_unpackhi_epi8(hi, zero), w));
        }
        a0 = _mm_srai_epi32(a0, PRECISION_BITS);
        a1 = _mm_srai_epi32(a1, PRECISION_BITS);
        a2 = _mm_srai_epi32(a2, PRECISION_BITS);
        a3 = _mm_srai_epi32(a3, PRECISION_BITS);
        _mm_storeu_si128((__m128i *)(dst + j),
                         _mm_packus_epi16(_mm_packs_epi32(a0, a1), _mm_packs_epi32(a2, a3)));
    }
#endif
    for (; j < len; j++) {
        int32_t acc = 1 << (PRECISION_BITS - 1);
        for (int t = 0; t < n; t++) acc += rows[t][j] * k[t];
        dst[j] = clip8(acc);
    }
}

/* One output row of the horizontal pass over RGBX pixels: dst[ox] = sum_t src[lo + t] * k[t]. */
static void horizontal_row(const uint8_t *src, const int *bounds, int x_off, const int16_t *coef, int ksize, int S,
                           uint8_t *dst) {
    for (int ox = 0; ox < S; ox++) {
        const uint8_t *p = src + (size_t)(bounds[2 * ox] - x_off) * 4;
        const int n = bounds[2 * ox + 1];
        const int16_t *k = coef + (size_t)ox * ksize;
#ifdef __SSE2__
        const __m128i zero = _mm_setzero_si128();
        __m128i acc = _mm_set1_epi32(1 << (PRECISION_BITS - 1));
        int t = 0;
        for (; t + 1 < n; t += 2) { /* two pixels: r0 r1 g0 g1 b0 b1 x0 x1 against w0 w1 w0 w1 .. */
            uint32_t a, b;
            memcpy(&a, p + (size_t)t * 4, 4);
            memcpy(&b, p + (size_t)(t + 1) * 4, 4);
            const __m128i ab = _mm_unpacklo_epi8(_mm_unpacklo_epi8(_mm_cvtsi32_si128((int)a), _mm_cvtsi32_si128((int)b)), zero);
            const __m128i w = _mm_set1_epi32((int)((uint16_t)k[t] | ((uint32_t)(uint16_t)k[t + 1] << 16)));
            acc = _mm_add_epi32(acc, _mm_madd_epi16(ab, w));
        }
        if (t < n) {
            uint32_t a;
            memcpy(&a, p + (size_t)t * 4, 4);
            const __m128i px = _mm_unpacklo_epi16(_mm_unpacklo_epi8(_mm_cvtsi32_si128((int)a), zero), zero);
            acc = _mm_add_epi32(acc, _mm_madd_epi16(px, _mm_set1_epi32((uint16_t)k[t])));
        }
        acc = _mm_srai_epi32(acc, PRECISION_BITS);
        const __m128i packed = _mm_packus_epi16(_mm_packs_epi32(acc, zero), zero);
        const uint32_t v = (uint32_t)_mm_cvtsi128_si32(packed);
        memcpy(dst + (size_t)ox * 4, &v, 4);
#else
        int32_t acc[4] = {1 << (PRECISION_BITS - 1), 1 << (PRECISION_BITS - 1), 1 << (PRECISION_BITS - 1),
                          1 << (PRECISION_BITS - 1)};
        for (int t = 0; t < n; t++)
            for (int c = 0; c < 4; c++) acc[c] += p[(size_t)t * 4 + c] * k[t];
        for (int c = 0; c < 4; c++) dst[(size_t)ox * 4 + c] = clip8(acc[c]);
#endif
    }
}

typedef struct {
    const uint8_t *data;
    size_t size;
    double box_x, box_y, box_w, box_h; /* in the original image's pixels */
    int out_size;
    int flip;
    void *out;       /* 3 x out_size x out_size, uint8 or float32 */
    int out_float;
    float mean[3], inv_std[3];
    int max_scans;     /* 0: no limit */
    size_t max_memory; /* 0: no limit */
    /* results */
    int unsupported; /* colour space we do not convert (CMYK / YCCK): caller falls back */
    int warnings;
    int scale_denom;
    char message[JMSG_LENGTH_MAX + 96];
} Job;

static int run(Job *job) {
    struct jpeg_decompress_struct cinfo;
    ErrorManager err;
    ScanLimit limit;
    Scratch *s = &scratch;
    const int S = job->out_size;

    cinfo.err = jpeg_std_error(&err.pub);
    err.pub.error_exit = on_error;
    err.pub.emit_message = on_message;
    err.refused = 0;
    if (setjmp(err.jump)) {
        if (err.refused)
            snprintf(job->message, sizeof job->message, "%s", err.message);
        else if (err.pub.msg_code == JERR_NO_BACKING_STORE) /* libjpeg hit max_memory_to_use */
            snprintf(job->message, sizeof job->message,
                     "JPEG needs more than max_memory (%zu bytes) of coefficient buffers", job->max_memory);
        else
            snprintf(job->message, sizeof job->message, "corrupt JPEG (%s)", err.message);
        jpeg_destroy_decompress(&cinfo);
        return 0;
    }
    jpeg_create_decompress(&cinfo);
    limit.pub.progress_monitor = on_progress;
    limit.max_scans = job->max_scans;
    limit.err = &err;
    cinfo.progress = &limit.pub;
    if (job->max_memory > 0) cinfo.mem->max_memory_to_use = (long)job->max_memory;
    jpeg_mem_src(&cinfo, (const unsigned char *)job->data, (unsigned long)job->size);
    jpeg_read_header(&cinfo, TRUE);
    if (cinfo.num_components != 1 && cinfo.num_components != 3) {
        job->unsupported = 1;
        jpeg_destroy_decompress(&cinfo);
        return 0;
    }
    const double W = cinfo.image_width, H = cinfo.image_height;
    if (job->box_x + job->box_w > W || job->box_y + job->box_h > H) {
        snprintf(job->message, sizeof job->message, "crop box %gx%g at (%g, %g) is outside the %gx%g image",
                 job->box_w, job->box_h, job->box_x, job->box_y, W, H);
        jpeg_destroy_decompress(&cinfo);
        return 0;
    }
    const size_t coef = coefficient_bytes(&cinfo);
    if (job->max_memory > 0 && coef > job->max_memory) {
        snprintf(job->message, sizeof job->message,
                 "JPEG needs %zu bytes of coefficient buffers (progressive or multi-scan %dx%d), over "
                 "max_memory (%zu)", coef, (int)cinfo.image_width, (int)cinfo.image_height, job->max_memory);
        jpeg_destroy_decompress(&cinfo);
        return 0;
    }
    /* The smallest DCT scale that still leaves the box at least S pixels on both sides. */
    int denom = 1;
    for (int d = 8; d >= 2; d /= 2) {
        if (job->box_w >= (double)S * d && job->box_h >= (double)S * d) {
            denom = d;
            break;
        }
    }
    cinfo.scale_num = 1;
    cinfo.scale_denom = denom;
    cinfo.out_color_space = JCS_EXT_RGBX; /* 4 bytes a pixel: whole pixels per SIMD lane */
    cinfo.dct_method = JDCT_ISLOW;
    jpeg_start_decompress(&cinfo);
    job->scale_denom = denom;
    const int ow = cinfo.output_width, oh = cinfo.output_height;
    const double fx = ow / W, fy = oh / H;

    /* Filter taps in the scaled image; the rows and columns they touch are all we decode. */
    const double scale_x = job->box_w * fx / S, scale_y = job->box_h * fy / S;
    const int ksx = kernel_size(scale_x), ksy = kernel_size(scale_y);
    const size_t ncoef = (size_t)S * (ksx + ksy);
    const int kmax = ksx > ksy ? ksx : ksy;
    if (!grow((void **)&s->coef, &s->coef_cap, ncoef * sizeof(int16_t)) ||
        !grow((void **)&s->bounds, &s->bounds_cap, (size_t)S * 4 * sizeof(int)) ||
        !grow((void **)&s->weights, &s->weights_cap, (size_t)kmax * sizeof(double))) {
        snprintf(job->message, sizeof job->message, "out of memory");
        jpeg_destroy_decompress(&cinfo);
        return 0;
    }
    int *bx = s->bounds, *by = s->bounds + 2 * S;
    int16_t *cx = s->coef, *cy = s->coef + (size_t)S * ksx;
    taps(job->box_x * fx, scale_x, ow, S, ksx, bx, cx, s->weights);
    taps(job->box_y * fy, scale_y, oh, S, ksy, by, cy, s->weights);
    int x_lo = bx[0], x_hi = bx[2 * (S - 1)] + bx[2 * (S - 1) + 1];
    int y_lo = by[0], y_hi = by[2 * (S - 1)] + by[2 * (S - 1) + 1];
    for (int i = 0; i < S; i++) { /* monotone for this filter; be safe anyway */
        if (bx[2 * i] < x_lo) x_lo = bx[2 * i];
        if (bx[2 * i] + bx[2 * i + 1] > x_hi) x_hi = bx[2 * i] + bx[2 * i + 1];
        if (by[2 * i] < y_lo) y_lo = by[2 * i];
        if (by[2 * i] + by[2 * i + 1] > y_hi) y_hi = by[2 * i] + by[2 * i + 1];
    }
    /* One pixel more on each side: fancy chroma upsampling treats the decoded region's edges as
     * the image's, so its first and last columns would differ from a whole-image decode. */
    JDIMENSION x_off = (JDIMENSION)(x_lo > 0 ? x_lo - 1 : 0);
    JDIMENSION width = (JDIMENSION)((x_hi < ow ? x_hi + 1 : ow) - (int)x_off);
    if (width < (JDIMENSION)ow) jpeg_crop_scanline(&cinfo, &x_off, &width); /* widens to iMCU edges */
    const int rw = (int)cinfo.output_width; /* == width after cropping */
    const int rh = y_hi - y_lo;
    if ((size_t)rw * rh > MAX_REGION_PIXELS) {
        snprintf(job->message, sizeof job->message, "region of %dx%d pixels exceeds the decoder's limit", rw,
                 rh);
        jpeg_destroy_decompress(&cinfo);
        return 0;
    }
    const size_t stride = (size_t)rw * 4;
    if (job->max_memory > 0 && coef + stride * rh > job->max_memory) {
        snprintf(job->message, sizeof job->message,
                 "decoding the %dx%d region needs %zu bytes (%zu of them coefficient buffers), over "
                 "max_memory (%zu)", rw, rh, coef + stride * rh, coef, job->max_memory);
        jpeg_destroy_decompress(&cinfo);
        return 0;
    }
    if (!grow((void **)&s->region, &s->region_cap, stride * rh) ||
        !grow((void **)&s->rows, &s->rows_cap, sizeof(JSAMPROW) * rh) ||
        !grow((void **)&s->vpass, &s->vpass_cap, stride * S) ||
        !grow((void **)&s->hpass, &s->hpass_cap, (size_t)S * 4 + 16)) {
        snprintf(job->message, sizeof job->message, "out of memory");
        jpeg_destroy_decompress(&cinfo);
        return 0;
    }
    if (y_lo > 0) jpeg_skip_scanlines(&cinfo, (JDIMENSION)y_lo);
    for (int r = 0; r < rh; r++) s->rows[r] = s->region + stride * r;
    int got = 0;
    while (got < rh) {
        JDIMENSION n = jpeg_read_scanlines(&cinfo, s->rows + got, (JDIMENSION)(rh - got));
        if (n == 0) break; /* suspended: cannot happen with a memory source, but never spin */
        got += (int)n;
    }
    job->warnings = (int)err.pub.num_warnings;
    jpeg_abort_decompress(&cinfo); /* the rows below the box are never decoded */
    jpeg_destroy_decompress(&cinfo);
    if (got < rh) {
        snprintf(job->message, sizeof job->message, "corrupt JPEG (decoded %d of %d rows)", got, rh);
        return 0;
    }

    /* Vertical pass first: S rows of the region's full width, over contiguous bytes. */
    for (int oy = 0; oy < S; oy++) {
        const int lo = by[2 * oy] - y_lo, n = by[2 * oy + 1];
        vertical_row((const uint8_t *const *)(s->rows + lo), cy + (size_t)oy * ksy, n, stride,
                     s->vpass + stride * oy);
    }
    /* Horizontal pass, then CHW out (mirrored when flipping), uint8 or normalised float32. */
    const size_t plane = (size_t)S * S;
    for (int oy = 0; oy < S; oy++) {
        horizontal_row(s->vpass + stride * oy, bx, (int)x_off, cx, ksx, S, s->hpass);
        const uint8_t *px = s->hpass;
        if (job->out_float) {
            float *o = (float *)job->out + (size_t)oy * S;
            for (int ox = 0; ox < S; ox++, px += 4) {
                const int at = job->flip ? S - 1 - ox : ox;
                o[at] = ((float)px[0] - job->mean[0]) * job->inv_std[0];
                o[plane + at] = ((float)px[1] - job->mean[1]) * job->inv_std[1];
                o[2 * plane + at] = ((float)px[2] - job->mean[2]) * job->inv_std[2];
            }
        } else {
            uint8_t *o = (uint8_t *)job->out + (size_t)oy * S;
            for (int ox = 0; ox < S; ox++, px += 4) {
                const int at = job->flip ? S - 1 - ox : ox;
                o[at] = px[0];
                o[plane + at] = px[1];
                o[2 * plane + at] = px[2];
            }
        }
    }
    return 1;
}

PyDoc_STRVAR(decode_doc,
             "decode_into(data, x, y, w, h, size, flip, out, mean=None, inv_std=None, max_scans=64, "
             "max_memory=335544320) -> (ok, scale_denom, warnings, message)\n\n"
             "Decode the box (x, y, w, h) of JPEG `data`, resize it to size x size, mirror it when `flip`, and "
             "write 3 x size x size CHW pixels into the writable buffer `out`: uint8 as decoded, or float32 "
             "(x - mean) * inv_std when `out` has 4-byte items (mean and inv_std: 3 floats each). ok is "
             "True, False with a message (corrupt data), or None when the colour space needs another "
             "decoder (CMYK). A JPEG with more than max_scans scans, or whose coefficient buffers and decoded "
             "region need more than max_memory bytes, is refused (ok False); 0 disables either limit.");

static PyObject *decode_into(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"data", "x",       "y",         "w",          "h", "size", "flip", "out",
                             "mean", "inv_std", "max_scans", "max_memory", NULL};
    Py_buffer data, out;
    double x, y, w, h;
    int size, flip;
    int max_scans = DEFAULT_MAX_SCANS;
    long long max_memory = DEFAULT_MAX_MEMORY;
    PyObject *mean = Py_None, *inv_std = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*ddddipw*|OOiL", kwlist, &data, &x, &y, &w, &h, &size, &flip,
                                     &out, &mean, &inv_std, &max_scans, &max_memory))
        return NULL;
    Job job;
    memset(&job, 0, sizeof job);
    PyObject *result = NULL;
    /* NaN passes every ordered comparison's negation: test for finite first (a NaN box used to
     * decode "successfully" into a black image). */
    if (!isfinite(x) || !isfinite(y) || !isfinite(w) || !isfinite(h)) {
        char text[160];
        snprintf(text, sizeof text, "x, y, w and h must be finite, got (%g, %g, %g, %g)", x, y, w, h);
        PyErr_SetString(PyExc_ValueError, text);
        goto done;
    }
    if (size < 1 || size > MAX_OUTPUT_SIDE || w <= 0 || h <= 0 || x < 0 || y < 0) {
        PyErr_Format(PyExc_ValueError, "size must be in [1, %d], w and h positive, x and y >= 0", MAX_OUTPUT_SIDE);
        goto done;
    }
    if (max_scans < 0 || max_memory < 0) {
        PyErr_SetString(PyExc_ValueError, "max_scans and max_memory must be >= 0 (0: no limit)");
        goto done;
    }
    job.max_scans = max_scans;
    job.max_memory = (size_t)max_memory;
    const size_t pixels = (size_t)3 * size * size;
    if (out.itemsize == 4 && (size_t)out.len == pixels * 4) {
        job.out_float = 1;
        PyObject *seqs[2] = {mean, inv_std};
        float *dsts[2] = {job.mean, job.inv_std};
        for (int s = 0; s < 2; s++) {
            PyObject *fast = PySequence_Fast(seqs[s], "mean and inv_std must be sequences of 3 floats");
            if (fast == NULL) goto done;
            if (PySequence_Fast_GET_SIZE(fast) != 3) {
                Py_DECREF(fast);
                PyErr_SetString(PyExc_ValueError, "mean and inv_std must have 3 values");
                goto done;
            }
            for (int c = 0; c < 3; c++) dsts[s][c] = (float)PyFloat_AsDouble(PySequence_Fast_GET_ITEM(fast, c));
            Py_DECREF(fast);
            if (PyErr_Occurred()) goto done;
        }
    } else if ((size_t)out.len != pixels) {
        PyErr_Format(PyExc_ValueError, "out holds %zd bytes; need %zu (uint8) or %zu (float32)", out.len, pixels,
                     pixels * 4);
        goto done;
    }
    job.data = data.buf;
    job.size = (size_t)data.len;
    job.box_x = x;
    job.box_y = y;
    job.box_w = w;
    job.box_h = h;
    job.out_size = size;
    job.flip = flip;
    job.out = out.buf;
    int ok;
    Py_BEGIN_ALLOW_THREADS ok = run(&job);
    Py_END_ALLOW_THREADS
    if (job.unsupported)
        result = Py_BuildValue("(Oiis)", Py_None, 0, 0, "unsupported colour space");
    else
        result = Py_BuildValue("(Oiis)", ok ? Py_True : Py_False, job.scale_denom, job.warnings,
                               ok ? "" : job.message);
done:
    PyBuffer_Release(&data);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"decode_into", (PyCFunction)(void (*)(void))decode_into, METH_VARARGS | METH_KEYWORDS, decode_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_turbo",
                                    "Region-of-interest JPEG decode + resize into CHW (libjpeg-turbo).", -1,
                                    methods};

PyMODINIT_FUNC PyInit__turbo(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    PyModule_AddIntConstant(m, "LIBJPEG_VERSION", JPEG_LIB_VERSION);
    return m;
}
