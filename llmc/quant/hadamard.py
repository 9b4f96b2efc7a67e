"""Orthogonal rotations for `type: rotate`: normalized Hadamard matrices (entries ±1/√n) with random signs, the
rotation QuaRot and SpinQuant start from. A Hadamard matrix of order n is built as the Kronecker product of a
Sylvester matrix (order 2^k) and a Paley matrix of order m = n / 2^k (Paley I: m = q + 1 with q prime, q ≡ 3 mod 4;
Paley II: m = 2(q + 1) with q prime, q ≡ 1 mod 4), which covers every hidden size of the supported families
(576 = 36 x 16, 3584 = 28 x 128, 4096 = 2^12, ...). Where no such order exists, a random orthogonal matrix (QR of a
Gaussian) stands in: still exact, spreads outliers less evenly."""
import torch


def _is_prime(q: int) -> bool:
    return q > 1 and all(q % d for d in range(2, int(q**0.5) + 1))


def _jacobsthal(q: int) -> torch.Tensor:
    """Q[i, j] = χ(j - i), χ the quadratic character mod q (1 on non-zero squares, -1 on non-squares, 0 at 0)."""
    squares = {(x * x) % q for x in range(1, q)}
    character = torch.tensor([0.0] + [1.0 if r in squares else -1.0 for r in range(1, q)], dtype=torch.float64)
    index = torch.arange(q)
    return character[(index[None, :] - index[:, None]) % q]


def _paley(m: int) -> torch.Tensor | None:
    """A ±1 Hadamard matrix of order m by Paley's constructions, or None where neither applies."""
    q = m - 1
    if _is_prime(q) and q % 4 == 3:  # Paley I: I + S, S the skew conference matrix [[0, 1ᵀ], [-1, Q]]
        skew = torch.zeros(m, m, dtype=torch.float64)
        skew[0, 1:], skew[1:, 0], skew[1:, 1:] = 1, -1, _jacobsthal(q)
        return torch.eye(m, dtype=torch.float64) + skew
    q = m // 2 - 1
    if m % 2 == 0 and _is_prime(q) and q % 4 == 1:  # Paley II: the symmetric conference matrix C, blown up 2x2
        conference = torch.zeros(m // 2, m // 2, dtype=torch.float64)
        conference[0, 1:], conference[1:, 0], conference[1:, 1:] = 1, 1, _jacobsthal(q)
        on_zero = torch.tensor([[1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
        on_sign = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
        return torch.kron(conference, on_sign) + torch.kron(torch.eye(m // 2, dtype=torch.float64), on_zero)
    return None


def hadamard_matrix(n: int) -> torch.Tensor | None:
    """A ±1 matrix H of order n with H Hᵀ = n I (float64), or None where this module has no construction."""
    power = 1
    while n % (power * 2) == 0:
        power *= 2
    while power >= 1:  # the largest Sylvester factor whose cofactor has a Paley matrix
        cofactor = n // power
        base = torch.ones(1, 1, dtype=torch.float64) if cofactor == 1 else _paley(cofactor)
        if base is not None:
            sylvester = torch.ones(1, 1, dtype=torch.float64)
            while sylvester.shape[0] < power:
                sylvester = torch.kron(sylvester, torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64))
            return torch.kron(base, sylvester)
        power //= 2
    return None


def random_rotation(n: int, seed: int) -> torch.Tensor:
    """An n x n orthogonal matrix (float64): a Hadamard matrix over √n with each row's sign drawn from seed, or a
    random orthogonal matrix where no Hadamard matrix of order n is built here."""
    generator = torch.Generator().manual_seed(seed)
    hadamard = hadamard_matrix(n)
    if hadamard is None:
        q, r = torch.linalg.qr(torch.randn(n, n, generator=generator, dtype=torch.float64))
        return q * torch.sign(torch.diagonal(r))
    signs = torch.randint(0, 2, (n,), generator=generator).to(torch.float64) * 2 - 1
    return signs[:, None] * hadamard / n**0.5
