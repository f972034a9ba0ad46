/* Bytes hashed as they are copied, in one loop per call (hetero-pd, backends/xxh3_io.py;
 * the transfer engine's checksums, transfer/checksum.py).
 *
 * hpd_copy_hashed copies a piece with memcpy and feeds that piece of the source and of the
 * destination to their running hashes at once, while both are still in this core's L1/L2
 * cache, then the next piece: one pass over the bytes from memory, and no Python between
 * pieces (the caller releases the GIL for the whole chunk, so two threads copy at once).
 *
 * The hash is not compiled here: `update` is xxh3's streaming update as the `xxhash`
 * package's extension module exports it (XXH3_64bits_update_dispatch: its AVX2 or AVX-512
 * code as the CPU has it), and a state is one that module created (XXH3_createState). So the
 * digests are exactly the package's, which a peer without this loop computes in Python.
 */
#include <stddef.h>
#include <string.h>

/* XXH3_64bits_update: (state, data, length) -> XXH_errorcode (0: ok). */
typedef int (*hpd_update_fn)(void *state, const void *data, size_t n);

/* Copies `n` bytes from `src` to `dst` (which do not overlap), `piece` at a time, feeding
 * each piece of the source to `src_state` and what landed in the destination to `dst_state`
 * right after its memcpy (either state may be NULL: not hashed). */
void hpd_copy_hashed(hpd_update_fn update, char *dst, const char *src, size_t n, size_t piece,
                     void *src_state, void *dst_state) {
    if (piece == 0)
        piece = n;
    for (size_t at = 0; at < n; at += piece) {
        size_t k = n - at < piece ? n - at : piece;
        memcpy(dst + at, src + at, k);
        if (src_state)
            update(src_state, src + at, k);
        if (dst_state)
            update(dst_state, dst + at, k);
    }
}
